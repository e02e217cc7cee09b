"""Answer accuracy of greedy generations on held-out prompts, decoded with MaxText's KV cache.

Held-out loss says how well the model predicts the reference solution; this says whether, left to itself, it
ends with the right `#### <answer>`. SFT's periodic evaluation; RL objectives sample several completions per prompt
instead (`maxtext_posttrain.evaluate`).
"""

from maxtext_posttrain import config as config_lib
from maxtext_posttrain.data import pipeline
from maxtext_posttrain.data import prompts as prompts_lib
from maxtext_posttrain.rewards import math as math_rewards


def greedy_answer_accuracy(loop, num_examples: int) -> dict[str, float]:
  """Decodes the first `num_examples` held-out prompts greedily with the current policy weights.

  Returns `eval/answer_accuracy` (the final answer equals the reference's, `rewards.math.correctness`) and
  `eval/format_accuracy` (a `####` answer was stated at all). The decoded texts of the last call are kept in
  `loop.cache["generations"]`.
  """
  config = loop.config
  if "greedy_eval" not in loop.cache:
    encoder = pipeline.Encoder.from_config(config)
    prompt_set = prompts_lib.load(config, train=False, limit=num_examples, encoder=encoder)
    loop.cache["greedy_eval"] = (encoder, prompt_set)
  encoder, prompt_set = loop.cache["greedy_eval"]
  outputs = loop.sampler().generate(
      loop.policy_params(),
      [list(ids) for ids in prompt_set.prompt_ids],
      config_lib.max_new_tokens(config),
      encoder.tokenizer.eos_id,
  )
  texts = [encoder.decode_completion(ids) for ids in outputs]
  answers = [math_rewards.extract_final_answer(text) for text in texts]
  correct = math_rewards.correctness(list(prompt_set.prompt_texts), texts, list(prompt_set.answers))
  loop.cache["generations"] = [
      {"prompt": prompt, "generation": text, "answer": answer, "reference": reference, "correct": bool(right)}
      for prompt, text, answer, reference, right in zip(
          prompt_set.prompt_texts, texts, answers, prompt_set.answers, correct
      )
  ]
  return {
      "eval/answer_accuracy": sum(correct) / len(texts),
      "eval/format_accuracy": sum(a is not None for a in answers) / len(texts),
  }

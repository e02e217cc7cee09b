"""Answer accuracy of greedy generations on held-out prompts, decoded with MaxText's KV cache.

Held-out loss says how well the model predicts the reference solution; this says whether, left to itself, it
ends with the right `#### <answer>`. Used as the objectives' periodic evaluation.
"""

from maxtext_posttrain import rollout
from maxtext_posttrain.data import pipeline
from maxtext_posttrain.peft import lora


def greedy_answer_accuracy(loop, num_examples: int) -> dict[str, float]:
  """Decodes the first `num_examples` held-out prompts greedily with the current policy weights.

  Returns `eval/answer_accuracy` (final answer equals the reference's) and `eval/format_accuracy` (a `####`
  answer was produced at all). The decoded texts of the last call are kept in `loop.cache["generations"]`.
  """
  config = loop.config
  if "greedy_eval" not in loop.cache:
    encoder = pipeline.Encoder.from_config(config)
    examples = pipeline.load_eval_examples(config, num_examples)
    loop.cache["greedy_eval"] = (rollout.Sampler(config, loop.mesh), encoder, examples)
  sampler, encoder, examples = loop.cache["greedy_eval"]
  eos_id = encoder.tokenizer.eos_id
  max_new_tokens = config.max_target_length - config.max_prefill_predict_length  # MaxText's decode budget
  outputs = sampler.generate(
      lora.policy_params(loop.policy(), config), [e["prompt_ids"] for e in examples], max_new_tokens, eos_id
  )
  texts = [encoder.tokenizer.decode([t for t in ids if t != eos_id]) for ids in outputs]
  answers = [pipeline.extract_answer(text) for text in texts]
  references = [pipeline.extract_answer(e["completion_text"]) for e in examples]
  loop.cache["generations"] = [
      {"prompt": e["prompt_text"], "generation": text, "answer": answer, "reference": reference}
      for e, text, answer, reference in zip(examples, texts, answers, references)
  ]
  return {
      "eval/answer_accuracy": sum(a is not None and a == r for a, r in zip(answers, references)) / len(examples),
      "eval/format_accuracy": sum(a is not None for a in answers) / len(examples),
  }

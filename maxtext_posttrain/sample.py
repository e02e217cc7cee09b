"""Samples completions of one prompt from a checkpoint with the RL sampler (MaxText's KV-cache decode path).

  python -m maxtext_posttrain.sample <config.yml> prompt="..." num_samples=4 [load_parameters_path=...] [key=value ...]

MaxText's keys keep their meaning: `prompt` (formatted with `prompt_template`, tokenized with the config's
tokenizer), `load_parameters_path` (params of an orbax checkpoint; random weights when unset; with
`lora.enable_lora=true` and `lora.lora_restore_path`, the adapters of a LoRA run on top),
`decode_sampling_strategy` / `_temperature` / `_top_k` / `_nucleus_p`, and the decode budget
`max_target_length - max_prefill_predict_length`. Two arguments are this command's own, because MaxText's config
has no per-prompt sample count (its `rl.num_generations` exists only in its RL config, `multi_sampling` is a switch)
and no sampling seed: `num_samples=N` (default 1) and `seed=S` (default 0). With `rl.tools` the policy calls them
as it does in RL rollouts (`rollout.tools`). Prints one JSON line per sample (with tools: its answered calls, and
the calls whose tool raised under `rl.tool_on_error=skip`).
"""

import json
from typing import Sequence

import jax


from maxtext_posttrain import cli
from maxtext_posttrain import config as posttrain_config
from maxtext_posttrain import mesh as mesh_lib
from maxtext_posttrain import rollout
from maxtext_posttrain.data import pipeline
from maxtext_posttrain.peft import lora
from maxtext_posttrain.rollout import tools as tools_lib

_OWN_ARGS = {"num_samples": 1, "seed": 0}


def _split_args(argv: Sequence[str]) -> tuple[list[str], dict[str, int]]:
  """Takes this command's own `num_samples=` and `seed=` out of MaxText-style argv."""
  own, rest = dict(_OWN_ARGS), []
  for arg in argv:
    key, _, value = arg.partition("=")
    if key in own and value:
      own[key] = int(value)
    else:
      rest.append(arg)
  return rest, own


def main(argv: Sequence[str]) -> None:
  argv, own = _split_args(argv)
  config = posttrain_config.initialize(list(argv))
  mesh = mesh_lib.make_mesh(config)
  model = lora.pretrained_model(config, mesh)  # load_parameters_path, and lora.lora_restore_path's adapters
  encoder = pipeline.Encoder.from_config(config)
  sampler = tools_lib.with_tools(rollout.Sampler(config, mesh), config, encoder)
  eos_id = encoder.tokenizer.eos_id
  rollouts = sampler.sample(
      lora.policy_params(model, config),
      [encoder.prompt_ids(config.prompt)],
      posttrain_config.max_new_tokens(config),
      eos_id,
      jax.random.key(own["seed"]),
      rollout.SamplingParams.from_config(config),
      num_samples=own["num_samples"],
  )
  for i, tokens in enumerate(rollouts.completions()):
    row = {
        "sample": i,
        "text": encoder.decode_completion(tokens),
        "num_tokens": int(rollouts.lengths[i]),
        "finish_reason": rollouts.finish_reasons[i],
        "logprob": float(rollouts.logprobs[i].sum()),
    }
    if rollouts.tool_calls is not None:
      row |= {"tool_calls": int(rollouts.tool_calls[i]), "tool_errors": int(rollouts.tool_errors[i])}
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
  cli.run(main)

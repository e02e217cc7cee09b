"""Sampled evaluation on held-out prompts: pass@1, unbiased pass@k, maj@k, format and partial accuracy.

  python -m maxtext_posttrain.evaluate <config.yml> load_parameters_path=<params> [key=value ...]
  python -m maxtext_posttrain.evaluate sft_lora.yml load_parameters_path=<base> lora.lora_restore_path=<adapters>

Each of the first `eval_generation_examples` held-out prompts (all of them when 0) gets `eval_samples_per_prompt`
completions, sampled with MaxText's `decode_sampling_*` keys by the rollout sampler (MaxText's KV-cache decode
path), and each completion is scored with the math rewards. Per prompt, with n samples of which c are correct:

  pass@k  = 1 - C(n - c, k) / C(n, k)   the chance that k of the n samples, drawn without replacement, include a
                                        correct one (Chen et al. 2021's unbiased estimator; pass@1 = c / n)
  maj@k   whether the most common final answer of the first k samples is correct (ties: the earliest answer)
  format  the share of samples ending in a well-formed `#### <number>` line
  partial the share of samples within 10% of the reference answer (correct ones included)

averaged over prompts, each with its standard error: the spread of that average over prompt sets resampled with
replacement (a bootstrap over prompts, seeded), so a reader can tell a gain from the noise of one draw of samples.
Sampling uses one fixed key (`rl.sampling_seed`), so two checkpoints are compared on the same random draws, and
`paired_stderr` gives the standard error of their difference over the same prompts. The command writes `<base_output_directory>/<run_name>/evaluation.json` and `evaluation.png`; RL
objectives run the same evaluation every `eval_interval` steps.
"""

import collections
import dataclasses
import json
from typing import Sequence

import jax
import matplotlib
import numpy as np
from flax import nnx

from maxtext_posttrain import cli
from maxtext_posttrain import config as posttrain_config
from maxtext_posttrain import mesh as mesh_lib
from maxtext_posttrain import reports
from maxtext_posttrain import rollout
from maxtext_posttrain.data import pipeline
from maxtext_posttrain.data import prompts as prompts_lib
from maxtext_posttrain.peft import lora
from maxtext_posttrain.rewards import math as math_rewards
from maxtext_posttrain.rollout import tools as tools_lib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=wrong-import-position

_EVAL_STREAM = 2**31 - 1  # folded into the sampling seed: evaluation draws apart from any training step's


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k), as a stable product."""
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}.")
  if n - c < k:
    return 1.0
  return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def majority_answer(answers: Sequence[str | None]) -> str | None:
  """The most common stated answer (numbers compared by value, e.g. `1,000` = `1000.0`); ties go to the earliest;
  None when no sample states one."""
  keys = []
  for answer in answers:
    number = None if answer is None else math_rewards.parse_number(answer)
    keys.append(None if answer is None else (number if number is not None else answer))
  counts = collections.Counter(k for k in keys if k is not None)
  if not counts:
    return None
  top = max(counts.values())
  return next(answer for answer, key in zip(answers, keys) if key is not None and counts[key] == top)


_BOOTSTRAP_RESAMPLES = 2000


def _bootstrap_rows(num_prompts: int, seed: int = 0) -> np.ndarray:
  """[resamples, num_prompts] prompt indices drawn with replacement, the same for every metric and model."""
  return np.random.default_rng(seed).integers(0, num_prompts, size=(_BOOTSTRAP_RESAMPLES, num_prompts))


def stderr(per_prompt: dict[str, Sequence[float]]) -> dict[str, float]:
  """The bootstrap standard error over prompts of each metric's mean."""
  rows = _bootstrap_rows(len(next(iter(per_prompt.values()))))
  return {name: float(np.std(np.asarray(values)[rows].mean(axis=1), ddof=1)) for name, values in per_prompt.items()}


def means_with_stderr(per_prompt: dict[str, Sequence[float]], prefix: str = "") -> dict[str, float]:
  """Each metric's mean over prompts and its bootstrap standard error (`<prefix><name>_stderr`)."""
  means = {f"{prefix}{name}": float(np.mean(values)) for name, values in per_prompt.items()}
  return means | {f"{prefix}{name}_stderr": value for name, value in stderr(per_prompt).items()}


def paired_stderr(before: dict[str, Sequence[float]], after: dict[str, Sequence[float]]) -> dict[str, float]:
  """The bootstrap standard error of each metric's mean difference `after - before` over the same prompts,
  resampled together (two models on the same prompts and draws err alike, so the difference is surer than
  either)."""
  return stderr({name: np.asarray(after[name]) - np.asarray(before[name]) for name in before})


def per_prompt_scores(
    texts: Sequence[Sequence[str]], answers: Sequence[str], ks: Sequence[int]
) -> dict[str, list[float]]:
  """The metrics of the module doc for each prompt; `texts[p]` are prompt p's n sampled completions (decoded)."""
  n = len(texts[0])
  if any(len(group) != n for group in texts):
    raise ValueError("Every prompt needs the same number of samples.")
  per_prompt = collections.defaultdict(list)
  for group, answer in zip(texts, answers, strict=True):
    golds = [answer] * n
    correct = math_rewards.correctness([""] * n, list(group), golds)
    per_prompt["format_accuracy"].append(np.mean(math_rewards.format([""] * n, list(group), golds)))
    per_prompt["partial_accuracy"].append(np.mean([s > 0 for s in math_rewards.partial([""] * n, list(group), golds)]))
    stated = [math_rewards.extract_final_answer(text) for text in group]
    gold = math_rewards.gold_answer(answer)
    for k in ks:
      per_prompt[f"pass_at_{k}"].append(pass_at_k(n, int(sum(correct)), k))
      majority = majority_answer(stated[:k])
      per_prompt[f"maj_at_{k}"].append(float(majority is not None and math_rewards.answers_equal(majority, gold)))
  return {name: [float(v) for v in values] for name, values in per_prompt.items()}


def score(texts: Sequence[Sequence[str]], answers: Sequence[str], ks: Sequence[int]) -> dict[str, float]:
  """The metrics of the module doc averaged over prompts."""
  return {name: float(np.mean(values)) for name, values in per_prompt_scores(texts, answers, ks).items()}


def sample_texts(
    sampler: rollout.Sampler | tools_lib.ToolUse,
    params: nnx.State,
    prompt_ids: Sequence[Sequence[int]],
    config,
    encoder: pipeline.Encoder,
    num_samples: int,
) -> list[list[str]]:
  """`num_samples` completions of every prompt, decoded, in chunks of the training batch's prompt count (the last
  chunk padded with repeats), so every chunk runs the same compiled decode program."""
  chunk = config.global_batch_size_to_train_on
  rng = jax.random.fold_in(jax.random.key(config.rl.sampling_seed), _EVAL_STREAM)
  max_new_tokens = posttrain_config.max_new_tokens(config)
  sampling = rollout.SamplingParams.from_config(config)
  texts = []
  for start in range(0, len(prompt_ids), chunk):
    indices = [min(i, len(prompt_ids) - 1) for i in range(start, start + chunk)]
    out = sampler.sample(
        params,
        [list(prompt_ids[i]) for i in indices],
        max_new_tokens,
        encoder.tokenizer.eos_id,
        jax.random.fold_in(rng, start),
        sampling,
        num_samples=num_samples,
    )
    completions = [encoder.decode_completion(tokens) for tokens in out.completions()]
    count = min(chunk, len(prompt_ids) - start)
    texts += [completions[p * num_samples : (p + 1) * num_samples] for p in range(count)]
  return texts


def evaluate(sampler, params, prompt_set, config, encoder: pipeline.Encoder) -> tuple[dict[str, float], list[dict]]:
  """(metrics, samples): the module doc's metrics of `params` on `prompt_set` with their standard errors
  (`<name>_stderr`), and each prompt's completions and scores."""
  texts = sample_texts(sampler, params, prompt_set.prompt_ids, config, encoder, config.eval_samples_per_prompt)
  per_prompt = per_prompt_scores(texts, prompt_set.answers[: len(texts)], config.eval_pass_at_k)
  metrics = means_with_stderr(per_prompt)
  samples = [
      {"prompt": prompt, "answer": answer, "completions": group, "scores": {k: v[p] for k, v in per_prompt.items()}}
      for p, (prompt, answer, group) in enumerate(zip(prompt_set.prompt_texts, prompt_set.answers, texts))
  ]
  return metrics, samples


def per_prompt_from_samples(samples: Sequence[dict]) -> dict[str, list[float]]:
  """The per-prompt scores `evaluate` stored in its samples, by metric."""
  return {name: [sample["scores"][name] for sample in samples] for name in samples[0]["scores"]}


def plot(metrics: dict[str, float], png_path: str, title: str) -> str:
  """Bars of every metric with their standard errors, pass@k and maj@k first; returns `png_path`."""
  names = [name for name in metrics if not name.endswith("_stderr")]
  names = sorted(names, key=lambda name: (not name.startswith(("pass_at_", "maj_at_")), name))
  fig, ax = plt.subplots(figsize=(1.2 * len(names) + 2, 3.5))
  errors = [metrics.get(f"{name}_stderr", 0.0) for name in names]
  bars = ax.bar(names, [metrics[name] for name in names], yerr=errors, capsize=3, color="tab:blue")
  ax.bar_label(bars, labels=[f"{metrics[name]:.1%}" for name in names])
  ax.set(ylim=(0, 1.05), ylabel="fraction of held-out prompts", title=title)
  fig.tight_layout()
  fig.savefig(png_path, dpi=110)
  plt.close(fig)
  return png_path


def main(argv: Sequence[str]) -> None:
  config = posttrain_config.initialize(list(argv))
  mesh = mesh_lib.make_mesh(config)
  model = lora.pretrained_model(config, mesh)  # load_parameters_path, and lora.lora_restore_path's adapters
  encoder = pipeline.Encoder.from_config(config)
  prompt_set = prompts_lib.load(config, train=False, limit=config.eval_generation_examples or None, encoder=encoder)
  sampler = tools_lib.with_tools(rollout.Sampler(config, mesh), config, encoder)
  metrics, samples = evaluate(sampler, lora.policy_params(model, config), prompt_set, config, encoder)
  print(json.dumps(metrics), flush=True)
  report = {
      "metrics": metrics,
      "params": reports.params_source(config),
      "prompts": prompt_set.describe(),
      "samples_per_prompt": config.eval_samples_per_prompt,
      "sampling": dataclasses.asdict(rollout.SamplingParams.from_config(config)),
      "samples": samples,
  }
  reports.write(config, "evaluation", report, lambda png: plot(metrics, png, f"{len(samples)} held-out prompts"))


if __name__ == "__main__":
  cli.run(main)

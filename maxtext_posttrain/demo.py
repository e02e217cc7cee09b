"""The project's main job on bundled data (`make demo`): SFT a tiny MaxText model on arithmetic word problems, then
improve its answers with RL (GRPO, a variant, or PPO), and compare the two on held-out problems.

  python -m maxtext_posttrain.demo [--mode=gspo_token|ppo] [--sft_steps=300] [--output_dir=demo_output] [key=value ...]

Stage 1 fine-tunes sft.yml's tiny decoder on the bundled train split and saves an orbax checkpoint (a later demo in
the same --output_dir reuses it, so `--mode=ppo` after `make demo` runs stage 2 only). Stage 2 starts grpo.yml (for
`--mode=ppo`, ppo.yml: the same prompts, completions per step and rewards, plus a critic and a KL-shaped reward)
from that checkpoint (`load_parameters_path`) with `posttrain_mode=--mode` and saves its final checkpoint;
its evaluations sample `eval_samples_per_prompt` completions for each of `eval_generation_examples` held-out prompts,
the first before any RL step (the SFT model) and the last after training (the RL model), with the same random
draws. `key=value` arguments override the RL stage's config. Prints the before/after table (pass@1, pass@k, maj@k,
format and partial accuracy, each with its bootstrap standard error over prompts, and the change with the standard
error of the paired difference), a few generations, and the commands that evaluate and sample the RL model; writes
reward and accuracy curves as a PNG.
"""

import json
import os
import platform
import shlex
import shutil
import time
from typing import Sequence

from absl import app
from absl import flags
import jax

from maxtext.utils import max_logging

from maxtext_posttrain import cli
from maxtext_posttrain import config as posttrain_config
from maxtext_posttrain import curves
from maxtext_posttrain import evaluate as evaluate_lib
from maxtext_posttrain import trainer
from maxtext_posttrain.rewards import math as math_rewards

_PPO = "ppo"
_MODE = flags.DEFINE_enum("mode", "grpo", [*sorted(posttrain_config.RL_PRESETS), _PPO], "RL stage's posttrain_mode.")
_SFT_STEPS = flags.DEFINE_integer("sft_steps", 300, "SFT steps of stage 1.")
_OUTPUT = flags.DEFINE_string("output_dir", "demo_output", "Where both stages write checkpoints, metrics and curves.")

_SAMPLE_PROMPT = "Tom has 3 apples. He buys 5 more. How many apples does Tom have?"


def _rows(config) -> list[tuple[str, str]]:
  """(label, metric) of the table: pass@k and maj@k for each k of `eval_pass_at_k`, then format and partial."""
  n = config.eval_samples_per_prompt
  rows = [(f"pass@{k}" if k == 1 else f"pass@{k} (unbiased, n={n})", f"pass_at_{k}") for k in config.eval_pass_at_k]
  rows += [(f"maj@{k}", f"maj_at_{k}") for k in config.eval_pass_at_k if k > 1]
  return rows + [("format accuracy", "format_accuracy"), ("partial accuracy (10%)", "partial_accuracy")]


def results_table(before: list[dict], after: list[dict], config, mode: str) -> str:
  """The before/after table from two evaluations' samples (`evaluate.evaluate`) on the same prompts and draws:
  each mean +- its bootstrap standard error, and the change in points +- the paired standard error (and relative)."""
  per_before = evaluate_lib.per_prompt_from_samples(before)
  per_after = evaluate_lib.per_prompt_from_samples(after)
  se_before, se_after = evaluate_lib.stderr(per_before), evaluate_lib.stderr(per_after)
  se_change = evaluate_lib.paired_stderr(per_before, per_after)
  title = f"held-out, {config.eval_samples_per_prompt} samples/prompt"
  lines = [f"{title:28s}{'SFT':>16s}{mode:>16s}{'change (points)':>22s}{'relative':>10s}"]
  for label, name in _rows(config):
    mean_before, mean_after = sum(per_before[name]) / len(before), sum(per_after[name]) / len(after)
    relative = (mean_after - mean_before) / mean_before if mean_before else float("nan")
    lines.append(
        f"{label:28s}{f'{mean_before:.1%} ± {se_before[name]:.1%}':>16s}{f'{mean_after:.1%} ± {se_after[name]:.1%}':>16s}"
        f"{f'{100 * (mean_after - mean_before):+.1f} ± {100 * se_change[name]:.1f}':>22s}{relative:>+10.1%}"
    )
  return "\n".join(lines)


def _machine() -> str:
  """The host's CPU and the jax build, which the table's exact figures depend on (see README: Reproducibility)."""
  cpu = platform.processor() or platform.machine()
  if os.path.exists("/proc/cpuinfo"):
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
  return f"{cpu}, {os.cpu_count()} cores, jax {jax.__version__} on {jax.devices()[0].platform}"


def _sft(output_dir: str, steps: int) -> tuple[str, str]:
  """Stage 1: the SFT run, or the one a previous demo left in `output_dir`; returns its final params' path and a
  note of how it was obtained."""
  argv = ["", "sft.yml", "run_name=demo_sft", f"base_output_directory={output_dir}"]
  argv += [f"steps={steps}", "eval_interval=0", f"checkpoint_period={steps}", "async_checkpointing=false"]
  config = posttrain_config.initialize(argv)
  params = os.path.join(config.checkpoint_dir, str(steps - 1), "items")
  if os.path.isdir(params):
    max_logging.log(f"Reusing the SFT checkpoint {params} of a previous demo run.")
    return params, "reused from a previous demo run"
  summary = trainer.train(trainer.setup(config))
  return params, f"{summary['seconds']:.0f} s"


def _config_file(mode: str) -> str:
  return "ppo.yml" if mode == _PPO else "grpo.yml"


def _commands(config, params: str, overrides: list[str]) -> list[str]:
  """Commands that evaluate the RL model and sample from it, with the RL stage's config and overrides."""
  base = [_config_file(config.posttrain_mode), f"base_output_directory={config.base_output_directory}", *overrides]
  evaluate = ["python", "-m", "maxtext_posttrain.evaluate", *base, f"run_name={config.run_name}_evaluation"]
  sample = ["python", "-m", "maxtext_posttrain.sample", *base, f"run_name={config.run_name}_sample"]
  sample += [f"prompt={_SAMPLE_PROMPT}", "num_samples=4"]
  return [
      shlex.join([*evaluate, f"load_parameters_path={params}"]),
      shlex.join([*sample, f"load_parameters_path={params}"]),
  ]


def main(argv: Sequence[str]) -> None:
  overrides = list(argv[1:])
  if not all("=" in a for a in overrides):
    raise app.UsageError(f"Arguments must be key=value overrides of the RL stage's config, got {overrides}.")
  started = time.perf_counter()
  output_dir, mode = os.path.abspath(_OUTPUT.value), _MODE.value  # orbax writes absolute paths only
  params, sft_note = _sft(output_dir, _SFT_STEPS.value)
  argv = ["", _config_file(mode), f"run_name=demo_{mode}", f"base_output_directory={output_dir}"]
  argv += [f"posttrain_mode={mode}", f"load_parameters_path={params}", "async_checkpointing=false"]
  argv += [f"metrics_file={os.path.join(output_dir, f'demo_{mode}_metrics.jsonl')}", *overrides]
  config = posttrain_config.initialize(argv)
  config = posttrain_config.with_overrides(config, checkpoint_period=config.steps)  # the RL model, not every 50 steps
  run_dir = os.path.join(output_dir, config.run_name)
  if os.path.isdir(run_dir):  # a rerun trains the RL stage again rather than resuming a finished run
    max_logging.log(f"Removing {run_dir}, the RL stage of a previous demo run.")
    shutil.rmtree(run_dir)
  os.makedirs(output_dir, exist_ok=True)
  loop = trainer.setup(config)
  summary = trainer.train(loop)
  evaluations = loop.cache["evaluations"]
  before, after = evaluations[min(evaluations)], evaluations[max(evaluations)]
  rl_params = os.path.join(config.checkpoint_dir, str(summary["end_step"] - 1), "items")
  png = curves.plot_run(config.metrics_file, os.path.join(output_dir, f"demo_{mode}_curves.png"))
  pass_at_1 = [sum(s["scores"]["pass_at_1"] for s in samples) / len(samples) for samples in (before, after)]
  gain = (pass_at_1[1] - pass_at_1[0]) / max(pass_at_1[0], 1e-9)
  report = [
      f"SFT ({_SFT_STEPS.value} steps, {sft_note}), then {mode} ({summary['end_step']} steps, "
      f"{summary['seconds']:.0f} s) of a {config.base_num_decoder_layers}-layer MaxText model on arithmetic word "
      f"problems; {len(after)} held-out prompts of {config.grain_eval_files}, the same samples' random draws for both "
      "models (± one bootstrap standard error over prompts; the change's is paired):",
      results_table(before, after, config, mode),
      f"pass@1 relative gain: {gain:+.1%} (target +20%: {'met' if gain >= 0.2 else 'NOT met'})",
      "",
      "Generations after RL (each prompt's first sample; two right and two wrong where there are):",
  ]
  firsts = [{"prompt": g["prompt"], "answer": g["answer"], "sample": g["completions"][0]} for g in after]
  right = math_rewards.correctness([], [f["sample"] for f in firsts], [f["answer"] for f in firsts])
  report += [json.dumps(f) for f, r in zip(firsts, right) if r][:2]
  report += [json.dumps(f) for f, r in zip(firsts, right) if not r][:2]
  evaluate_command, sample_command = _commands(config, rl_params, overrides)
  report += [
      "",
      f"The RL model: {rl_params}",
      f"Evaluate it (the table's last column again):\n  {evaluate_command}",
      f"Sample from it:\n  {sample_command}",
      f"Curves: {png}",
      f"Machine: {_machine()}",
      f"Total time: {time.perf_counter() - started:.0f} s",
  ]
  print("\n".join(report), flush=True)


if __name__ == "__main__":
  cli.run(main)

"""The project's main job on bundled data (`make demo`): SFT a tiny MaxText model on arithmetic word problems, then
improve its answers with GRPO, and compare the two on held-out problems.

  python -m maxtext_posttrain.demo [--mode=gspo_token] [--sft_steps=300] [key=value ...]

Stage 1 fine-tunes configs/sft.yml's tiny decoder on the bundled train split and saves an orbax checkpoint (a later
demo in the same --output_dir reuses it, so `--mode=gspo_token` after `make demo` runs stage 2 only). Stage 2
starts configs/grpo.yml from that checkpoint (`load_parameters_path`) with `posttrain_mode=--mode`; its
evaluations sample 8 completions for each of 128 held-out prompts, the first before any RL step (the SFT model) and
the last after training (the RL model), with the same random draws. `key=value` arguments override the RL stage's
config. Prints the before/after table (pass@1, pass@5, maj@5, format and partial accuracy) and a few generations,
and writes reward and accuracy curves as a PNG.
"""

import json
import os
import time
from typing import Sequence

from absl import app
from absl import flags

from maxtext.utils import max_logging

from maxtext_posttrain import config as posttrain_config
from maxtext_posttrain import curves
from maxtext_posttrain import trainer
from maxtext_posttrain.rewards import math as math_rewards

_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
_MODE = flags.DEFINE_enum("mode", "grpo", sorted(posttrain_config.RL_PRESETS), "RL stage's posttrain_mode.")
_SFT_STEPS = flags.DEFINE_integer("sft_steps", 300, "SFT steps of stage 1.")
_OUTPUT = flags.DEFINE_string("output_dir", "demo_output", "Where both stages write checkpoints, metrics and curves.")

ROWS = (
    ("pass@1", "eval/pass_at_1"),
    ("pass@5 (unbiased, n=8)", "eval/pass_at_5"),
    ("maj@5", "eval/maj_at_5"),
    ("format accuracy", "eval/format_accuracy"),
    ("partial accuracy (10%)", "eval/partial_accuracy"),
)


def results_table(before: dict[str, float], after: dict[str, float], mode: str) -> str:
  lines = [f"{'held-out, 8 samples/prompt':28s}{'SFT':>10s}{mode:>12s}{'change':>10s}"]
  for label, key in ROWS:
    change = (after[key] - before[key]) / before[key] if before[key] else float("nan")
    lines.append(f"{label:28s}{before[key]:>10.1%}{after[key]:>12.1%}{change:>+10.1%}")
  return "\n".join(lines)


def _sft(output_dir: str, steps: int) -> tuple[str, str]:
  """Stage 1: the SFT run, or the one a previous demo left in `output_dir`; returns its final params' path and a
  note of how it was obtained."""
  argv = ["", os.path.join(_CONFIGS, "sft.yml"), "run_name=demo_sft", f"base_output_directory={output_dir}"]
  argv += [f"steps={steps}", "eval_interval=0", f"checkpoint_period={steps}", "async_checkpointing=false"]
  config = posttrain_config.initialize(argv)
  params = os.path.join(config.checkpoint_dir, str(steps - 1), "items")
  if os.path.isdir(params):
    max_logging.log(f"Reusing the SFT checkpoint {params} of a previous demo run.")
    return params, "reused from a previous demo run"
  summary = trainer.train(trainer.setup(config))
  return params, f"{summary['seconds']:.0f} s"


def main(argv: Sequence[str]) -> None:
  overrides = list(argv[1:])
  if not all("=" in a for a in overrides):
    raise app.UsageError(f"Arguments must be key=value overrides of configs/grpo.yml, got {overrides}.")
  started = time.perf_counter()
  output_dir, mode = os.path.abspath(_OUTPUT.value), _MODE.value  # orbax writes absolute paths only
  params, sft_note = _sft(output_dir, _SFT_STEPS.value)
  argv = ["", os.path.join(_CONFIGS, "grpo.yml"), f"run_name=demo_{mode}", f"base_output_directory={output_dir}"]
  argv += [f"posttrain_mode={mode}", f"load_parameters_path={params}", "enable_checkpointing=false"]
  argv += [f"metrics_file={os.path.join(output_dir, f'demo_{mode}_metrics.jsonl')}", *overrides]
  config = posttrain_config.initialize(argv)
  os.makedirs(output_dir, exist_ok=True)
  loop = trainer.setup(config)
  summary = trainer.train(loop)
  evals = summary["evals"]
  before, after = evals[min(evals)], evals[max(evals)]
  png = curves.plot_run(config.metrics_file, os.path.join(output_dir, f"demo_{mode}_curves.png"))
  gain = (after["eval/pass_at_1"] - before["eval/pass_at_1"]) / max(before["eval/pass_at_1"], 1e-9)
  report = [
      f"SFT ({_SFT_STEPS.value} steps, {sft_note}), then {mode} ({summary['end_step']} steps, "
      f"{summary['seconds']:.0f} s) of a {config.base_num_decoder_layers}-layer MaxText model on arithmetic word "
      f"problems; {config.eval_generation_examples} held-out prompts of {config.grain_eval_files}:",
      results_table(before, after, mode),
      f"pass@1 relative gain: {gain:+.1%} (target +20%: {'met' if gain >= 0.2 else 'NOT met'})",
      "",
      "Generations after RL (each prompt's first sample; two right and two wrong where there are):",
  ]
  firsts = [
      {"prompt": g["prompt"], "answer": g["answer"], "sample": g["completions"][0]} for g in loop.cache["generations"]
  ]
  right = math_rewards.correctness([], [f["sample"] for f in firsts], [f["answer"] for f in firsts])
  report += [json.dumps(f) for f, r in zip(firsts, right) if r][:2]
  report += [json.dumps(f) for f, r in zip(firsts, right) if not r][:2]
  report.append(f"Curves: {png}")
  report.append(f"Total time: {time.perf_counter() - started:.0f} s")
  print("\n".join(report), flush=True)
  max_logging.log(f"demo results: before={before} after={after}")


if __name__ == "__main__":
  app.run(main)

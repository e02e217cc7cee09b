"""The project's main job on bundled data (`make demo`): SFT a tiny MaxText model on arithmetic word problems.

Prints held-out loss and greedy answer accuracy before and after training, a few generations, and writes the
training curves as a PNG beside the run's checkpoints. Extra `key=value` arguments override configs/sft.yml:

  python -m maxtext_posttrain.demo [key=value ...]
"""

import json
import os
from typing import Sequence

from absl import app

from maxtext.utils import max_logging

from maxtext_posttrain import config as posttrain_config
from maxtext_posttrain import curves
from maxtext_posttrain import trainer

_REPO_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "sft.yml")
DEFAULTS = (
    "run_name=demo",
    "base_output_directory=demo_output",
    "steps=300",
    "eval_interval=100",
    "eval_generation_examples=128",
    "enable_checkpointing=false",
    "metrics_file=demo_output/demo_metrics.jsonl",
)

ROWS = (
    ("held-out loss", "eval/loss", "{:.3f}"),
    ("answer accuracy (greedy)", "eval/answer_accuracy", "{:.1%}"),
    ("format accuracy (#### N)", "eval/format_accuracy", "{:.1%}"),
)


def results_table(before: dict[str, float], after: dict[str, float]) -> str:
  lines = [f"{'':28s}{'before':>10s}{'after':>10s}"]
  for label, key, fmt in ROWS:
    lines.append(f"{label:28s}{fmt.format(before[key]):>10s}{fmt.format(after[key]):>10s}")
  return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
  overrides = list(argv[1:])
  if not all("=" in a for a in overrides):
    raise app.UsageError(f"Arguments must be key=value overrides of configs/sft.yml, got {overrides}.")
  config = posttrain_config.initialize(["", _REPO_CONFIG, *DEFAULTS, *overrides])
  os.makedirs(os.path.dirname(os.path.abspath(config.metrics_file)), exist_ok=True)
  loop = trainer.setup(config)
  summary = trainer.train(loop)
  evals = summary["evals"]
  before, after = evals[min(evals)], evals[max(evals)]
  png = curves.plot_run(config.metrics_file, os.path.join(config.base_output_directory, f"{config.run_name}_curves.png"))
  report = [
      f"SFT of a {config.base_num_decoder_layers}-layer MaxText model on arithmetic word problems "
      f"({summary['end_step']} steps, {summary['seconds']:.0f} s), held-out split of {config.grain_eval_files}:",
      results_table(before, after),
      "",
      "Generations after training (two right, two wrong where there are):",
  ]
  generations = loop.cache.get("generations", [])
  right = [g for g in generations if g["answer"] == g["reference"]][:2]
  wrong = [g for g in generations if g["answer"] != g["reference"]][:2]
  report += [json.dumps(sample) for sample in right + wrong]
  report.append(f"Curves: {png}")
  print("\n".join(report), flush=True)
  max_logging.log(f"demo results: before={before} after={after}")


if __name__ == "__main__":
  app.run(main)

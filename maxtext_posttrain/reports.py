"""Where the evaluation commands write: one JSON report and one PNG each, beside the run's other outputs.

`evaluate`, `safety_eval` and `canary_exposure` each measure a checkpoint; their reports name the weights measured
and land in `<base_output_directory>/<run_name>/`, written once, by process 0 (every process holds the same figures).
"""

import json
import os
from typing import Callable

import jax

from maxtext.utils import max_logging


def params_source(config) -> str:
  """The weights a command measured: `load_parameters_path`, or the seeded initialisation."""
  return config.load_parameters_path or f"random init (init_weights_seed={config.init_weights_seed})"


def write(config, name: str, report: dict, draw: Callable[[str], str]) -> None:
  """Process 0 writes `report` as `<run>/<name>.json` and draws `<run>/<name>.png` with `draw(path)`."""
  if jax.process_index() != 0:
    return
  out_dir = os.path.join(config.base_output_directory, config.run_name)
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, f"{name}.json"), "w", encoding="utf-8") as f:
    json.dump(report, f, indent=1)
  png = draw(os.path.join(out_dir, f"{name}.png"))
  max_logging.log(f"Wrote {out_dir}/{name}.json and {png}.")

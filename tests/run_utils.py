"""Running the loop in tests and reading back what it logged."""

import json
import os

from maxtext_posttrain import trainer

# Decoder layers of the session's deeper SFT model (conftest's deep_sft_checkpoint); the usual tiny model has 2.
DEEP_SFT_LAYERS = 4

# Every setup reads and tokenizes each example of its training split once (`split_pass`): about 2 s for the bundled
# 20,000 problems on 2 cores, a good part of a short test. conftest's `make_config` reads their first 2,000 (a TFDS
# slice; a few dozen steps use fewer), tests whose claim is learning read the whole split (WHOLE_TRAIN_SPLIT).
SHORT_TRAIN_SPLIT = "train_split=train[:2000]"
WHOLE_TRAIN_SPLIT = "train_split=train"


def xla_flags(devices: int | None = None) -> str:
  """XLA_FLAGS for a test's subprocess: this process's flags (the Makefile's single-threaded matmuls for two workers
  on two cores) without their device count, and `devices` CPU devices when given."""
  kept = [
      f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")
  ]
  return " ".join(kept + ([f"--xla_force_host_platform_device_count={devices}"] if devices else []))


def run(config):
  """(loop, summary) of a full run of `config`."""
  loop = trainer.setup(config)
  return loop, trainer.train(loop)


def losses(metrics_file) -> dict[int, float]:
  """Training loss per step from MaxText's metrics_file (a resumed step keeps its last value)."""
  with open(metrics_file, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  return {int(r["step"]): r["learning/loss"] for r in rows if "learning/loss" in r}


def rows(metrics_file) -> dict[int, dict]:
  """MaxText's metrics_file rows of training steps, by step (a resumed step keeps its last row)."""
  with open(metrics_file, encoding="utf-8") as f:
    return {int(r["step"]): r for r in map(json.loads, f) if "learning/loss" in r}

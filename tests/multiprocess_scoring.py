"""Which rows each process builds when a frozen model scores rows in calls (`roles.FrozenModel.run_over_rows`, as DPO's
precomputed reference, canary exposure and score_teacher do), and what every process gets back: run by
tests/test_multiprocess.py through tests/train_in_turn.py (a group `@tests.multiprocess_scoring ...`), in one process
or under scripts/launch_local.sh; alone as

  python -m tests.multiprocess_scoring <out_dir> <name> <config.yml> key=value ...

Scores ROWS seeded rows (their token log-prob sums under the config's seeded model, the last call filled with repeats)
and writes `<out_dir>/<name>.<process>.json`: the row indices this process built, per call, and the scores it got.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from maxtext_posttrain import config as posttrain_config
from maxtext_posttrain import forward
from maxtext_posttrain import mesh as mesh_lib
from maxtext_posttrain import roles

ROWS, TOKENS = 10, 12


def row_logps(model, batch):
  logps, _ = forward.token_logps(model, batch["inputs"], batch["positions"], batch["segmentation"], batch["targets"])
  return jnp.sum(logps * batch["segmentation"], axis=-1)


def main(argv: list[str]) -> None:
  out_dir, name, *config_argv = argv[1:]
  config = posttrain_config.initialize(["", *config_argv])
  scorer = roles.build_frozen(roles.reference(), config, mesh_lib.make_mesh(config), copy=True)
  length, built = config.max_target_length, []

  def rows_at(indices):
    built.append([int(i) for i in indices])
    tokens = np.stack([np.random.default_rng(i).integers(3, config.vocab_size, TOKENS + 1) for i in indices])
    segmentation = np.zeros((len(indices), length), np.int32)
    segmentation[:, :TOKENS] = 1
    inputs, targets = np.zeros_like(segmentation), np.zeros_like(segmentation)
    inputs[:, :TOKENS], targets[:, :TOKENS] = tokens[:, :-1], tokens[:, 1:]
    positions = np.where(segmentation != 0, np.arange(length, dtype=np.int32), 0)
    return {"inputs": inputs, "positions": positions, "segmentation": segmentation, "targets": targets}

  calls = scorer.run_over_rows(row_logps, ROWS, rows_at, config.global_batch_size_to_train_on, label=name)
  scores = np.concatenate([out for _, out in calls])
  os.makedirs(out_dir, exist_ok=True)  # a job run again after an XLA:CPU abort starts from an empty directory
  with open(f"{out_dir}/{name}.{jax.process_index()}.json", "w", encoding="utf-8") as f:
    json.dump({"built": built, "scores": scores.tolist(), "batch_size": config.global_batch_size_to_train_on}, f)


if __name__ == "__main__":
  main(sys.argv)

"""Which examples each process's batches hold: run by tests/test_multiprocess.py, alone or under
scripts/launch_local.sh.

  python -m tests.multiprocess_data <out_dir> <steps> <name> <config.yml> key=value ... [-- <name> <config.yml> ...]

For each named config, builds the run's mesh and its objective's training data exactly as `maxtext_posttrain.train`
does, takes `steps` global batches and writes `<out_dir>/<name>.<process>.json`: the identities of the examples in
this process's block of rows, per step: the prompt index for RL objectives, a digest of the row's tokens otherwise
(one example per row: packing=false).
"""

import hashlib
import json
import sys

import jax
import numpy as np

from maxtext_posttrain import config as posttrain_config
from maxtext_posttrain import mesh as mesh_lib
from maxtext_posttrain import objectives
from maxtext_posttrain.data import pipeline
from maxtext_posttrain.data import prompts

# The keys whose rows name an example, per kind of batch.
_IDENTITY_KEYS = ((prompts.INDEX_KEY,), ("chosen_inputs", "rejected_inputs"), ("inputs",))


def example_ids(batch: dict[str, jax.Array]) -> list[str]:
  keys = next(keys for keys in _IDENTITY_KEYS if all(key in batch for key in keys))
  rows = [pipeline.local_rows(batch[key]) for key in keys]
  if keys == (prompts.INDEX_KEY,):
    return [str(int(i)) for i in rows[0][:, 0]]
  return [
      hashlib.sha256(b"".join(np.ascontiguousarray(r[i]).tobytes() for r in rows)).hexdigest()[:16]
      for i in range(len(rows[0]))
  ]


def main(argv: list[str]) -> None:
  out_dir, steps = argv[1], int(argv[2])
  groups = " ".join(argv[3:]).split(" -- ")
  for name, *config_argv in (group.split() for group in groups):
    config = posttrain_config.initialize(["", *config_argv])
    mesh = mesh_lib.make_mesh(config)
    data = objectives.get(config.posttrain_mode)(config).make_data(mesh)
    ids = [example_ids(next(data.train)) for _ in range(steps)]
    with open(f"{out_dir}/{name}.{jax.process_index()}.json", "w", encoding="utf-8") as f:
      json.dump({"process": jax.process_index(), "processes": jax.process_count(), "steps": ids}, f)


if __name__ == "__main__":
  main(sys.argv)

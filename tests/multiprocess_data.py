"""Which examples each process's batches hold: run by tests/test_multiprocess.py through tests/train_in_turn.py (a
group `@tests.multiprocess_data ...`), in one process or under scripts/launch_local.sh; alone as

  python -m tests.multiprocess_data <out_dir> <steps> <name> <config.yml> key=value ...

For the named config, builds the run's mesh and its objective's training data exactly as `maxtext_posttrain.train`
does, takes `steps` global batches and writes `<out_dir>/<name>.<process>.json`: the identities of the examples in
this process's block of rows, per step: the prompt index for RL objectives, a digest of the row's tokens otherwise
(one example per row: packing=false); and how many records this process read from the split's source (every read
is followed by its tokenization), with the split's size.
"""

import hashlib
import json
import os
import sys

import jax
import numpy as np

from maxtext_posttrain import config as posttrain_config
from maxtext_posttrain import mesh as mesh_lib
from maxtext_posttrain import objectives
from maxtext_posttrain.data import pipeline
from maxtext_posttrain.data import prompts
from maxtext_posttrain.data import sources

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


class _CountingSource(sources.RecordSource):
  """A record source that counts the records it reads, one at a time or a block at a time (the probe opens sources
  through it)."""

  reads = 0

  def __getitem__(self, index):
    _CountingSource.reads += 1
    return super().__getitem__(index)

  def read(self, indices):
    _CountingSource.reads += len(indices)
    return super().read(indices)


def _open_counting_source(*args, **kwargs) -> sources.RecordSource:
  source = _OPEN_SOURCE(*args, **kwargs)
  _OPENED.append(len(source))
  return _CountingSource(source.rows, source.description)


_OPEN_SOURCE, _OPENED = sources.open_source, []


def main(argv: list[str]) -> None:
  """Writes the probe's summary of one config. The counting source is patched in for the probe's own reads only, so
  the runs a job makes before or after it (tests/train_in_turn.py) read the plain sources."""
  out_dir, steps, name, *config_argv = argv[1:]
  config = posttrain_config.initialize(["", *config_argv])
  mesh = mesh_lib.make_mesh(config)
  _CountingSource.reads, _OPENED[:] = 0, []
  sources.open_source = _open_counting_source
  try:
    data = objectives.get(config.posttrain_mode)(config).make_data(mesh)
    ids = [example_ids(next(data.train)) for _ in range(int(steps))]
  finally:
    sources.open_source = _OPEN_SOURCE
  summary = {"process": jax.process_index(), "processes": jax.process_count(), "steps": ids}
  summary |= {"source_sizes": list(_OPENED), "reads": _CountingSource.reads}
  os.makedirs(out_dir, exist_ok=True)  # a job run again after an XLA:CPU abort starts from an empty directory
  with open(f"{out_dir}/{name}.{jax.process_index()}.json", "w", encoding="utf-8") as f:
    json.dump(summary, f)


if __name__ == "__main__":
  main(sys.argv)

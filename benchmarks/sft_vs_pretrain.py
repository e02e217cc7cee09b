"""SFT step time against MaxText's pretraining step on the same model, batch, sequence length and mesh.

Both steps are jitted by MaxText's `train_utils.jit_train_step` with the same state shardings and donation, and
run on the same SFT batch (a packed batch is a valid pretraining batch) in one process, alternating, so machine
noise hits both alike. Prints and writes JSON rows `{objective, step_time_s, pretrain_step_time_s, ratio}`.

  python -m benchmarks.sft_vs_pretrain [sft.yml] [key=value ...] [--repeats=N] [--output=path.json]
"""

import statistics
import sys
import time

import jax
from flax.linen import partitioning as nn_partitioning


from benchmarks import harness
from maxtext_posttrain import trainer


def _timed(step_fn, state, batch):
  start = time.perf_counter()
  state, metrics = step_fn(state, batch)
  jax.block_until_ready((state, metrics))
  return state, time.perf_counter() - start


def main(argv):
  args = harness.parse(argv)
  repeats = int(args.flag("repeats", "10"))
  output = args.flag("output", "benchmark_sft_vs_pretrain.json")
  config = args.config("sft")
  loop = trainer.setup(config)
  train_step = lambda state, batch: loop.primary.p_train_step(state, batch, {})  # no in-step frozen roles
  p_pretrain_step = harness.jit_pretraining_step(loop)
  batch = loop.train_batches.load_next_batch()
  state = loop.primary.state
  times = {"sft": [], "pretrain": []}
  with jax.set_mesh(loop.mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
    for fn in (train_step, p_pretrain_step):  # compile both, and one warm step each
      for _ in range(2):
        state, _ = _timed(fn, state, batch)
    for _ in range(repeats):
      state, seconds = _timed(p_pretrain_step, state, batch)
      times["pretrain"].append(seconds)
      state, seconds = _timed(train_step, state, batch)
      times["sft"].append(seconds)
  row = {
      "objective": "sft",
      "step_time_s": statistics.median(times["sft"]),
      "pretrain_step_time_s": statistics.median(times["pretrain"]),
  }
  row["ratio"] = row["step_time_s"] / row["pretrain_step_time_s"]
  loop.primary.state = state
  harness.write_row(row, loop, repeats, times, output, ("objective", "step_time_s", "pretrain_step_time_s", "ratio"))


if __name__ == "__main__":
  main(sys.argv)

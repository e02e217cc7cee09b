"""DPO step time against MaxText's pretraining step on the same model, pairs' sequence length and mesh.

A DPO step on B pairs is the reference's forward over the 2B sequences (its own jitted program) plus the policy's
forward and backward over the same 2B rows. Counting a forward as one third of a forward+backward, FLOPs predict
DPO / pretraining (B sequences) = 2 + 2/3 = 2.67, and 2.0 when reference log-probs are precomputed. Both steps are
jitted by MaxText's `train_utils.jit_train_step` with the same state shardings and donation and run alternately in
one process; the pretraining batch is the pairs' chosen rows. Prints and writes JSON rows
`{objective, step_time_s, reference_time_s, train_time_s, pretrain_step_time_s, ratio, predicted_ratio}`.

  python -m benchmarks.dpo_vs_pretrain [dpo.yml] [key=value ...] [--repeats=N] [--output=path.json]
"""

import statistics
import sys
import time

import jax
from flax.linen import partitioning as nn_partitioning


from benchmarks import harness
from maxtext_posttrain import trainer

PREDICTED_RATIO = 2 + 2 / 3  # policy fwd+bwd on 2B rows (2 x 3 units) + reference fwd on 2B rows (2 units), over 3


def _pretraining_batch(batch):
  """The chosen rows as a MaxText pretraining batch (inputs/targets with positions and segment ids)."""
  return {
      "inputs": batch["chosen_inputs"],
      "inputs_position": batch["chosen_positions"],
      "inputs_segmentation": batch["chosen_segmentation"],
      "targets": batch["chosen_targets"],
      "targets_position": batch["chosen_positions"],
      "targets_segmentation": batch["chosen_segmentation"],
  }


def _timed(fn, *args):
  start = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return out, time.perf_counter() - start


def main(argv):
  args = harness.parse(argv, default_config="dpo.yml")
  repeats = int(args.flag("repeats", "10"))
  output = args.flag("output", "benchmark_dpo_vs_pretrain.json")
  config = args.config("dpo", "dpo.max_prompt_length=128")
  loop = trainer.setup(config)
  train_step = lambda state, batch: loop.primary.p_train_step(state, batch, {})  # no in-step frozen roles
  p_pretrain_step = harness.jit_pretraining_step(loop)
  pairs = loop.train_batches.load_next_batch()
  pretrain_batch = _pretraining_batch(pairs)
  times = {"reference": [], "train": [], "pretrain": []}

  def dpo_step(state):
    loop.primary.state = state
    batch, reference_s = _timed(loop.objective.before_step, loop, pairs)
    (state, _), train_s = _timed(train_step, loop.primary.state, batch)
    return state, reference_s, train_s

  state = loop.primary.state
  with jax.set_mesh(loop.mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
    for _ in range(2):  # compile both, and one warm step each
      state, _, _ = dpo_step(state)
      (state, _), _ = _timed(p_pretrain_step, state, pretrain_batch)
    for _ in range(repeats):
      (state, _), seconds = _timed(p_pretrain_step, state, pretrain_batch)
      times["pretrain"].append(seconds)
      state, reference_s, train_s = dpo_step(state)
      times["reference"].append(reference_s)
      times["train"].append(train_s)
  step_times = [r + t for r, t in zip(times["reference"], times["train"])]
  row = {
      "objective": f"dpo ({config.dpo['algo']})",
      "step_time_s": statistics.median(step_times),
      "reference_time_s": statistics.median(times["reference"]),
      "train_time_s": statistics.median(times["train"]),
      "pretrain_step_time_s": statistics.median(times["pretrain"]),
      "predicted_ratio": PREDICTED_RATIO,
  }
  row["ratio"] = row["step_time_s"] / row["pretrain_step_time_s"]
  row["ratio_vs_predicted"] = row["ratio"] / PREDICTED_RATIO
  loop.primary.state = state
  printed = ("objective", "step_time_s", "reference_time_s", "train_time_s", "pretrain_step_time_s", "ratio")
  harness.write_row(row, loop, repeats, times, output, (*printed, "predicted_ratio", "ratio_vs_predicted"))


if __name__ == "__main__":
  main(sys.argv)

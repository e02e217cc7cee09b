"""A GRPO step split into rollout, reference and train time, the train part against MaxText's pretraining step on the
same tokens, model and mesh.

A GRPO step samples G completions for each of B prompts (MaxText decoding with the KV cache), scores them, runs the
frozen reference's forward over the B x G rows (when rl.grpo_beta > 0), then the policy's forward and backward over
the same rows. The train part does what a pretraining step does on those rows, except that the LM head and the
softmax run on the completion positions only (`rl_base.completion_index`), plus the clipped-ratio loss and an entropy
there; `train_flops_ratio` is the two compiled programs' FLOP ratio, the prediction for `train_ratio`. Both steps
are jitted by MaxText's `train_utils.jit_train_step` with the same state shardings and donation and run one after the
other on each rollout batch in one process, the one that goes first alternating, and `train_ratio` is the median of
the rounds' ratios; the pretraining batch is the GRPO rows themselves (prompt + completion tokens, with their
positions and segment ids).
Prints and writes JSON rows `{objective, step_time_s, rollout_time_s, reward_time_s, reference_time_s, train_time_s,
pretrain_step_time_s, train_ratio, train_flops_ratio}`.

  python -m benchmarks.grpo_vs_pretrain [grpo.yml] [key=value ...] [--repeats=N] [--output=path.json]
"""

import statistics
import sys
import time

import jax
from flax.linen import partitioning as nn_partitioning

from benchmarks import harness
from maxtext_posttrain import config as config_lib
from maxtext_posttrain import trainer


def pretraining_batch(batch):
  """The GRPO rows as a MaxText pretraining batch (inputs/targets with positions and segment ids)."""
  return {
      "inputs": batch["inputs"],
      "inputs_position": batch["positions"],
      "inputs_segmentation": batch["segmentation"],
      "targets": batch["targets"],
      "targets_position": batch["positions"],
      "targets_segmentation": batch["segmentation"],
  }


def main(argv):
  args = harness.parse(argv, default_config="grpo.yml")
  repeats = int(args.flag("repeats", "5"))
  output = args.flag("output", "benchmark_grpo_vs_pretrain.json")
  # One prompt per device x 8 samples: as many rows as the SFT and DPO benchmarks' pretraining batch.
  config = args.config(
      "grpo", "per_device_batch_size=1", "rl.num_generations=8", "max_prefill_predict_length=128", "rl.grpo_beta=0.04"
  )
  loop = trainer.setup(config)
  # MaxText's step trains on its config's batch size of rows: B x G here, the rows of one GRPO step.
  rows = config.global_batch_size_to_train_on * config.rl.num_generations
  pretrain_config = config_lib.with_overrides(
      config, micro_batch_size_to_train_on=rows, global_batch_size_to_train_on=rows
  )
  p_pretrain_step = harness.jit_pretraining_step(loop, pretrain_config)
  times = {"rollout": [], "reward": [], "reference": [], "train": [], "pretrain": []}

  def run(step, state, batch):
    start = time.perf_counter()
    state, _ = jax.block_until_ready(step(state, batch))
    return state, time.perf_counter() - start

  steps = {
      "train": lambda state, batch: loop.primary.p_train_step(state, batch, {}),
      "pretrain": lambda state, batch: p_pretrain_step(state, pretraining_batch(batch)),
  }
  state = loop.primary.state
  with jax.set_mesh(loop.mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
    for repeat in range(-2, repeats):  # two warm-up rounds compile every program
      loop.primary.state = state
      batch = loop.objective.before_step(loop, loop.train_batches.load_next_batch())
      metrics = dict(loop.objective.step_metrics)
      for part in sorted(steps, reverse=repeat % 2 == 1):  # which step runs first alternates per round
        state, seconds = run(steps[part], state, batch)
        if repeat >= 0:
          times[part].append(seconds)
      if repeat >= 0:
        for part in ("rollout", "reward", "reference"):
          times[part].append(metrics.get(f"rl/{part}_seconds", 0.0))
    # The two programs' FLOPs as XLA counts them (compiled again, not run), the prediction the times are set against.
    flops = {
        "train": loop.primary.p_train_step.lower(state, batch, {}),
        "pretrain": p_pretrain_step.lower(state, pretraining_batch(batch)),
    }
    flops = {part: lowered.compile().cost_analysis()["flops"] for part, lowered in flops.items()}
  row = {"objective": f"{config.posttrain_mode} (G={config.rl.num_generations}, beta={config.rl.grpo_beta})"}
  for part in ("rollout", "reward", "reference", "train"):
    row[f"{part}_time_s"] = statistics.median(times[part])
  row["step_time_s"] = sum(row[f"{part}_time_s"] for part in ("rollout", "reward", "reference", "train"))
  row["pretrain_step_time_s"] = statistics.median(times["pretrain"])
  # Each round times both steps on the same rows: the median of the rounds' ratios pairs them.
  row["train_ratio"] = statistics.median(t / p for t, p in zip(times["train"], times["pretrain"]))
  row["train_flops_ratio"] = flops["train"] / flops["pretrain"]
  row["completion_tokens_mean"] = metrics["rl/completion_length_mean"]
  loop.primary.state = state
  printed = ("objective", "step_time_s", "rollout_time_s", "reward_time_s", "reference_time_s", "train_time_s")
  harness.write_row(
      row, loop, repeats, times, output, (*printed, "pretrain_step_time_s", "train_ratio", "train_flops_ratio")
  )


if __name__ == "__main__":
  main(sys.argv)

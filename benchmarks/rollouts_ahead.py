"""A GRPO step with rollouts sampled one update ahead (`rl.off_policy_steps=1`) against the same step back to back.

The run's devices are split by MaxText's `trainer_devices_fraction` / `sampler_devices_fraction` (halves by default):
the trainer's mesh takes the first half, the sampler's the second. One loop, two ways of stepping it, alternating in
blocks of `--block` steps in one process:

- back to back (`rl.off_policy_steps=0` behaviour): the step samples its own rollouts on the sampler's devices, waits
  for them, scores them, runs the reference and the train step on the trainer's devices;
- ahead (`rl.off_policy_steps=1`): the step takes the rollouts the previous step dispatched, dispatches the next
  step's with the current weights (copied to the sampler's devices) and trains while they decode.

A step is timed from its start to the end of its train step (waited for). The first step of each block is left out
(an ahead block's first step samples its own rollouts; a back-to-back block's first step may find the rollouts the
previous block dispatched). Prints the medians, the ratio ahead / back to back and writes one JSON row; the parts of
the back-to-back step (rollout, reward, reference, train) say what overlap can hide at most: the step cannot be
shorter than its longer side.

  XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m benchmarks.rollouts_ahead [grpo.yml] [key=value ...]
      [--repeats=2] [--block=3] [--output=benchmark_rollouts_ahead.json]
"""

import statistics
import sys
import time

import jax
from flax.linen import partitioning as nn_partitioning

from benchmarks import harness
from maxtext_posttrain import trainer

PARTS = ("rollout", "reward", "reference")


def main(argv):
  if jax.device_count() < 2:
    raise SystemExit(
        f"benchmarks.rollouts_ahead splits the devices between trainer and sampler; this process has "
        f"{jax.device_count()}. On CPU: XLA_FLAGS=--xla_force_host_platform_device_count=4."
    )
  args = harness.parse(argv, default_config="grpo.yml")
  repeats, block = int(args.flag("repeats", "2")), int(args.flag("block", "3"))
  output = args.flag("output", "benchmark_rollouts_ahead.json")
  # Half a prompt per device x 8 samples: 2 prompts on 4 devices, one per trainer device, 16 rows a step.
  config = args.config(
      "rollouts_ahead", "per_device_batch_size=0.5", "rl.num_generations=8", "max_prefill_predict_length=128",
      "rl.grpo_beta=0.04", "rl.off_policy_steps=1", f"steps={(2 * repeats + 1) * block + 1}",
  )  # fmt: skip
  loop = trainer.setup(config)
  times = {"ahead": [], "back_to_back": [], "train": []} | {part: [] for part in PARTS}

  def step():
    start = time.perf_counter()
    batch = loop.train_batches.load_next_batch() if loop.objective.wants_batch(loop) else None
    batch = loop.objective.before_step(loop, batch)
    train_start = time.perf_counter()
    jax.block_until_ready(loop.primary.train_step(batch, loop.frozen_states()))
    end = time.perf_counter()
    loop.step += 1
    return end - start, end - train_start, dict(loop.objective.step_metrics)

  with jax.set_mesh(loop.mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
    for repeat in range(-1, repeats):  # the first round compiles every program
      for mode, steps_ahead in (("back_to_back", 0), ("ahead", 1)):
        loop.objective.off_policy_steps = steps_ahead
        for index in range(block):
          seconds, train_seconds, metrics = step()
          if repeat < 0 or index == 0:
            continue
          times[mode].append(seconds)
          if mode == "back_to_back":
            times["train"].append(train_seconds)
            for part in PARTS:
              times[part].append(metrics.get(f"rl/{part}_seconds", 0.0))
  row = {"objective": f"{config.posttrain_mode} (G={config.rl.num_generations}, beta={config.rl.grpo_beta})"}
  row |= {f"{name}_time_s": statistics.median(values) for name, values in times.items()}
  row["ahead_ratio"] = row["ahead_time_s"] / row["back_to_back_time_s"]
  row["trainer_devices"] = int(loop.mesh.devices.size)
  row["sampler_devices"] = int(loop.rollout_mesh.devices.size)
  row["completion_tokens_mean"] = metrics["rl/completion_length_mean"]
  printed = ("objective", "back_to_back_time_s", "ahead_time_s", "ahead_ratio", "rollout_time_s", "train_time_s")
  harness.write_row(row, loop, repeats, times, output, (*printed, "reference_time_s", "reward_time_s"))


if __name__ == "__main__":
  main(sys.argv)

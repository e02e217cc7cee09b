"""A PPO step split into rollout, reward, critic forward, reference, policy train and critic train time, the two train
parts against MaxText's pretraining step on the same tokens, model and mesh, with the FLOP prediction.

A PPO step samples G completions for each of B prompts (MaxText decoding with the KV cache), scores them, runs the
frozen reference's forward and the critic's forward over the B x G rows, then the policy's forward and backward
and the critic's forward and backward over the same rows (one minibatch, one epoch). The policy's train step does
what a pretraining step does on those rows, except that its LM head runs on the completion positions only
(max_new_tokens of max_target_length: `rl_base.completion_index`), plus the clipped-ratio loss and an entropy there,
so FLOPs predict it at 1 - (LM head share of the pretraining FLOPs) x (the prompt's share of the positions); the
critic is the same decoder without the LM head's projection (its scalar head reads the final hidden state; XLA drops
the unused logits), so FLOPs predict it at 1 - (LM head share).
Both train parts are measured by the loop's own per-role timing (`perf/<role>_train_seconds`); the pretraining step
is MaxText's, jitted by MaxText with the same state shardings and donation, run alternately in one process on the
PPO rows.

The loop runs one jitted step per trained role. The row also measures the alternative, one program over both roles
(the two steps traced into one jit, both states donated), on the same rows in the same process: its time against the
two programs dispatched back to back, and XLA's temporary bytes of each program (`memory_analysis`), since the fused
program holds both roles' activations and gradients at once where the separate ones hold one role's at a time.

Prints and writes JSON rows `{objective, step_time_s, rollout_time_s, reward_time_s, critic_forward_time_s,
reference_time_s, policy_train_time_s, critic_train_time_s, pretrain_step_time_s, train_ratio, flops_prediction,
ratio_to_prediction, separate_train_time_s, fused_train_time_s, fused_vs_separate, policy_temp_bytes,
critic_temp_bytes, fused_temp_bytes}`.

  python -m benchmarks.ppo_vs_pretrain [ppo.yml] [key=value ...] [--repeats=N] [--output=path.json]
"""

import statistics
import sys
import time

import jax
from flax.linen import partitioning as nn_partitioning

from benchmarks import harness
from benchmarks.grpo_vs_pretrain import pretraining_batch
from maxtext.utils import maxtext_utils
from maxtext_posttrain import config as config_lib
from maxtext_posttrain import trainer

PARTS = ("rollout", "reward", "critic_forward", "reference")
TRAIN_PARTS = ("policy_train", "critic_train")


def flops_prediction(config) -> float:
  """(policy train + critic train) / pretraining step, by FLOPs: (1 - head x prompt share) + (1 - head), with head
  the LM head's share of a training step and prompt share the positions outside the completion window."""
  total, _, _ = maxtext_utils.calculate_tflops_training_per_device(config, log=False)
  tokens_per_device = config.per_device_batch_size * config.max_target_length
  head = 6 * tokens_per_device * config.emb_dim * config.vocab_size / 1e12 / total
  prompt_share = 1 - config_lib.max_new_tokens(config) / config.max_target_length
  return 2.0 - head * prompt_share - head


def fused_train_step(policy, critic):
  """One program running the policy's and the critic's jitted train steps on the same batch, both states donated."""

  def step(policy_state, critic_state, batch, frozen_states):
    return policy.p_train_step(policy_state, batch, frozen_states), critic.p_train_step(
        critic_state, batch, frozen_states
    )

  return jax.jit(step, donate_argnums=(0, 1))


def temp_bytes(jitted, *args) -> int:
  """XLA's temporary (scratch) bytes of `jitted`'s compiled program for `args`."""
  return int(jitted.lower(*args).compile().memory_analysis().temp_size_in_bytes)


def main(argv):
  args = harness.parse(argv, default_config="ppo.yml")
  repeats = int(args.flag("repeats", "5"))
  output = args.flag("output", "benchmark_ppo_vs_pretrain.json")
  # One prompt per device x 8 samples: as many rows as the other benchmarks' pretraining batch.
  config = args.config(
      "ppo", "per_device_batch_size=1", "rl.num_generations=8", "max_prefill_predict_length=128", "rl.grpo_beta=0.04"
  )
  loop = trainer.setup(config)
  rows = config.global_batch_size_to_train_on * config.rl.num_generations
  pretrain_config = config_lib.with_overrides(
      config,
      micro_batch_size_to_train_on=rows,
      global_batch_size_to_train_on=rows,
      per_device_batch_size=rows / jax.device_count(),  # for MaxText's FLOP count of the step
  )
  p_pretrain_step = harness.jit_pretraining_step(loop, pretrain_config)
  policy, critic = loop.primary, loop.trained["critic"]
  p_fused = fused_train_step(policy, critic)
  times = {part: [] for part in (*PARTS, *TRAIN_PARTS, "pretrain", "separate_train", "fused_train")}

  with jax.set_mesh(loop.mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
    for repeat in range(-2, repeats):  # two warm-up rounds compile every program
      batch = loop.objective.before_step(loop, loop.train_batches.load_next_batch())
      metrics = dict(loop.objective.step_metrics)
      scalars = trainer._train_step(loop, batch)[0]["scalar"]  # pylint: disable=protected-access
      loop.step += 1
      start = time.perf_counter()
      policy.state, _ = jax.block_until_ready(p_pretrain_step(policy.state, pretraining_batch(batch)))
      pretrain_time = time.perf_counter() - start
      frozen_states = loop.frozen_states()
      start = time.perf_counter()
      policy.state, _ = policy.p_train_step(policy.state, batch, frozen_states)
      critic.state, _ = critic.p_train_step(critic.state, batch, frozen_states)
      jax.block_until_ready((policy.state, critic.state))
      separate_time = time.perf_counter() - start
      start = time.perf_counter()
      (policy.state, _), (critic.state, _) = p_fused(policy.state, critic.state, batch, frozen_states)
      jax.block_until_ready((policy.state, critic.state))
      fused_time = time.perf_counter() - start
      if repeat >= 0:
        times["pretrain"].append(pretrain_time)
        times["separate_train"].append(separate_time)
        times["fused_train"].append(fused_time)
        for part in PARTS:
          times[part].append(metrics.get(f"rl/{part}_seconds", 0.0))
        times["policy_train"].append(float(scalars["perf/policy_train_seconds"]))
        times["critic_train"].append(float(scalars["perf/critic_train_seconds"]))
  row = {"objective": f"ppo (G={config.rl.num_generations}, beta={config.rl.grpo_beta})"}
  for part in (*PARTS, *TRAIN_PARTS):
    row[f"{part}_time_s"] = statistics.median(times[part])
  row["step_time_s"] = sum(row[f"{part}_time_s"] for part in (*PARTS, *TRAIN_PARTS))
  row["pretrain_step_time_s"] = statistics.median(times["pretrain"])
  row["train_ratio"] = (row["policy_train_time_s"] + row["critic_train_time_s"]) / row["pretrain_step_time_s"]
  row["flops_prediction"] = flops_prediction(pretrain_config)
  row["ratio_to_prediction"] = row["train_ratio"] / row["flops_prediction"]
  row["completion_tokens_mean"] = metrics["rl/completion_length_mean"]
  row["separate_train_time_s"] = statistics.median(times["separate_train"])
  row["fused_train_time_s"] = statistics.median(times["fused_train"])
  row["fused_vs_separate"] = row["fused_train_time_s"] / row["separate_train_time_s"]
  with jax.set_mesh(loop.mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
    frozen_states = loop.frozen_states()
    row["policy_temp_bytes"] = temp_bytes(policy.p_train_step, policy.state, batch, frozen_states)
    row["critic_temp_bytes"] = temp_bytes(critic.p_train_step, critic.state, batch, frozen_states)
    row["fused_temp_bytes"] = temp_bytes(p_fused, policy.state, critic.state, batch, frozen_states)
  printed = ("objective", "step_time_s", *(f"{p}_time_s" for p in (*PARTS, *TRAIN_PARTS)), "pretrain_step_time_s")
  fused = ("separate_train_time_s", "fused_train_time_s", "fused_vs_separate")
  fused += ("policy_temp_bytes", "critic_temp_bytes", "fused_temp_bytes")
  harness.write_row(
      row, loop, repeats, times, output, (*printed, "train_ratio", "flops_prediction", "ratio_to_prediction", *fused)
  )


if __name__ == "__main__":
  main(sys.argv)

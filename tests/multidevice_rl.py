"""Prints the per-step rewards and losses of a short GRPO run; run in a subprocess with fake CPU devices.

  XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/multidevice_rl.py OUT_DIR TFDS_DIR \\
      '["ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"]'

Prints one JSON line: {"mesh": {...}, "rewards": [...], "losses": [...], "kl": [...]}.
"""

import json
import pathlib
import sys

from maxtext_posttrain import config as posttrain_config
from maxtext_posttrain import trainer

# 4 prompts x 4 samples a step, a reward that varies under random weights, and a KL term (so the reference runs).
RUN = (
    "per_device_batch_size=4", "rl.num_generations=4", "max_target_length=80", "enable_checkpointing=false",
    'rl.rewards=["tests.rewards_for_tests:characters"]', "rl.reward_weights=[1.0]", "rl.grpo_beta=0.1",
    "learning_rate=1e-2", "learning_rate_schedule_steps=8", "steps=3", "eval_interval=0",
)  # fmt: skip


def run(out_dir: str, tfds_dir: str, overrides: list[str], run_name: str) -> dict:
  metrics_file = pathlib.Path(out_dir) / f"{run_name}.jsonl"
  config = posttrain_config.initialize(
      ["", "grpo.yml", f"run_name={run_name}", f"base_output_directory={out_dir}"]
      + [f"dataset_path={tfds_dir}", f"metrics_file={metrics_file}", *RUN, *overrides]
  )
  loop = trainer.setup(config)
  trainer.train(loop)
  rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
  rows = [row for row in rows if "learning/loss" in row]
  return {
      "mesh": dict(loop.mesh.shape),
      "rewards": [row["rl/reward_mean"] for row in rows],
      "losses": [row["learning/loss"] for row in rows],
      "kl": [row["learning/kl"] for row in rows],
  }


if __name__ == "__main__":
  print(json.dumps(run(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), "multidevice")), flush=True)

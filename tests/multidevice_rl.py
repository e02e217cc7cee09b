"""The per-step rewards and losses of a short GRPO (or PPO) run: {"mesh": {...}, "rewards": [...], "losses": [...],
"kl": [...], ...} (PPO: also "value_losses" and "explained_variance"; "kl" is the rollout's KL to the reference).
Run on one device by tests/test_sharding.py and with fake CPU devices by tests/on_four_devices.py."""

import json
import pathlib

from maxtext_posttrain import config as posttrain_config
from maxtext_posttrain import trainer

# 4 prompts x 4 samples a step, a reward that varies under random weights, and a KL term (so the reference runs).
RUN = (
    "per_device_batch_size=4", "rl.num_generations=4", "max_target_length=80", "enable_checkpointing=false",
    'rl.rewards=["tests.rewards_for_tests:characters"]', "rl.reward_weights=[1.0]", "rl.grpo_beta=0.1",
    "learning_rate=1e-2", "learning_rate_schedule_steps=8", "steps=3", "eval_interval=0",
)  # fmt: skip


def run(out_dir: str, tfds_dir: str, overrides: list[str], run_name: str, config_file: str = "grpo.yml") -> dict:
  metrics_file = pathlib.Path(out_dir) / f"{run_name}.jsonl"
  config = posttrain_config.initialize(
      ["", config_file, f"run_name={run_name}", f"base_output_directory={out_dir}"]
      + [f"dataset_path={tfds_dir}", f"metrics_file={metrics_file}", *RUN, *overrides]
  )
  loop = trainer.setup(config)
  trainer.train(loop)
  rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
  rows = [row for row in rows if "learning/loss" in row]
  ppo = config.posttrain_mode == "ppo"
  out = {
      "mesh": dict(loop.mesh.shape),
      "rollout_devices": sorted(d.id for d in loop.rollout_mesh.devices.flat),
      "trainer_devices": sorted(d.id for d in loop.mesh.devices.flat),
      "staleness": [row["rl/staleness"] for row in rows],
      "rewards": [row["rl/reward_mean"] for row in rows],
      "losses": [row["learning/loss"] for row in rows],
      "kl": [row["rl/kl" if ppo else "learning/kl"] for row in rows],
  }
  if ppo:
    out["value_losses"] = [row["critic/loss"] for row in rows]
    out["explained_variance"] = [row["rl/explained_variance"] for row in rows]
  return out

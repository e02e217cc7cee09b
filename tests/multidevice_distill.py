"""The per-step losses of short distillation runs (distill.yml with feature and attention transfer through a learned
feature map, and distill_on_policy.yml); run with fake CPU devices by tests/on_four_devices.py."""

import json
import pathlib

from maxtext_posttrain import config as posttrain_config
from maxtext_posttrain import trainer

STEPS = 3
# The same global batch on every layout (4 rows), a learning rate that moves the student, and a moving alpha.
RUN = (
    "enable_checkpointing=false", "eval_interval=0", f"steps={STEPS}", "learning_rate=1e-3",
    "learning_rate_schedule_steps=8", "warmup_steps_fraction=0",
)  # fmt: skip
CONFIGS = {
    "distill.yml": (
        "distill_alpha_end=0.1",
        "distill_alpha_schedule=linear",
        "distill_temperature=2.0",
        # a 64-wide student matched to the teacher's layers 1 and 3 through its learned map, attention too
        "base_emb_dim=64",
        "head_dim=16",
        "distill_beta=1.0",
        "distill.attention_weight=0.25",
        "distill_layer_indices=[0,1]",
        "distill.teacher_layer_indices=[1,3]",
    ),
    "distill_on_policy.yml": ("distill.on_policy_fraction=0.5", "rl.num_generations=2"),
}


def run(out_dir: str, tfds_dir: str, student: str, teacher: str, layout: list[str], config_file: str) -> dict:
  name = f"{config_file.removesuffix('.yml')}_{len(layout)}"
  metrics_file = pathlib.Path(out_dir) / f"{name}.jsonl"
  argv = ["", config_file, f"run_name={name}", f"base_output_directory={out_dir}", f"dataset_path={tfds_dir}"]
  argv += [f"metrics_file={metrics_file}", f"teacher_overrides.load_parameters_path={teacher}", *RUN]
  argv += [*CONFIGS[config_file], *layout]
  if config_file == "distill_on_policy.yml":
    argv.append(f"load_parameters_path={student}")  # samples of a student that can answer
  loop = trainer.setup(posttrain_config.initialize(argv))
  trainer.train(loop)
  rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
  rows = [row for row in rows if "learning/loss" in row]
  return {
      "config": config_file,
      "mesh": dict(loop.mesh.shape),
      "losses": [row["learning/loss"] for row in rows],
      "divergence": [row["learning/divergence"] for row in rows],
      "feature_loss": [row.get("learning/feature_loss", 0.0) for row in rows],
  }


def run_all(out_dir: str, tfds_dir: str, student: str, teacher: str, layout: list[str]) -> list[dict]:
  """`run` of each of CONFIGS: {"config": ..., "mesh": {...}, "losses": [...], "divergence": [...],
  "feature_loss": [...]}."""
  return [run(out_dir, tfds_dir, student, teacher, layout, config_file) for config_file in CONFIGS]

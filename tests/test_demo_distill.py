"""The distillation demo (`python -m maxtext_posttrain.demo --mode=distill`) end to end, at a tiny size."""

import json
import os
import shlex

from maxtext_posttrain import demo
from maxtext_posttrain import evaluate

TEACHER_STEPS = 200  # conftest's deep_sft_checkpoint: the 4-layer SFT run a previous demo would have left
ROWS = ["teacher (4 layers)", "student SFT (4 steps)", "student SFT (2 steps)", "student offline KD", "student on-policy"]
METRICS = ["pass_at_1", "pass_at_2", "maj_at_2", "format_accuracy", "partial_accuracy"]


def test_the_distill_demo_reports_every_model_with_commands_that_reproduce_its_rows(tmp_path, deep_sft_checkpoint):
  """The session's 4-layer SFT model in the teacher's place (the demo reuses it, as a rerun does), then 4 steps per
  student on 16 problems: the table has a row per model and a change per student, each stage prints its command, and
  the teacher row's evaluate command, run as printed, gives the row's figures."""
  checkpoints = tmp_path / "demo_teacher" / "checkpoints"
  checkpoints.mkdir(parents=True)
  os.symlink(deep_sft_checkpoint.parent, checkpoints / str(TEACHER_STEPS - 1))
  evaluation = ["eval_generation_examples=4", "eval_samples_per_prompt=2", "eval_pass_at_k=[1,2]"]
  lines = "\n".join(demo.distill(str(tmp_path), TEACHER_STEPS, 4, 16, evaluation)).splitlines()

  assert "(reused from a previous demo run)" in lines[1]
  header = next(i for i, line in enumerate(lines) if line.startswith("held-out, 2 samples/prompt"))
  assert lines[header].split()[3:6] == ["pass@1", "pass@2", "maj@2"]
  rows = lines[header + 1 : header + 6]
  assert [row[:28].strip() for row in rows] == ROWS and all(row.count("±") == 5 for row in rows)
  assert [change[:28].strip() for change in lines[header + 7 : header + 10]] == ROWS[2:]
  stages = next(i for i, line in enumerate(lines) if line.startswith("Each stage's command"))
  evaluations = lines.index("Each row's evaluation:")
  assert [line.split(": ", 1)[1].split()[:3] for line in lines[stages + 1 : evaluations]] == [
      ["python", "-m", f"maxtext_posttrain.{module}"] for module in ("train", "train", "score_teacher", "train", "train")
  ]
  commands = dict(line.strip().split(": ", 1) for line in lines[evaluations + 1 :])
  assert list(commands) == ROWS
  for run in (
      "demo_student_sft/checkpoints/3",
      "demo_student_offline/checkpoints/3",
      "demo_student_on_policy/checkpoints/1",
  ):
    assert (tmp_path / run / "items").is_dir(), run

  argv = shlex.split(commands["teacher (4 layers)"])
  assert argv[:3] == ["python", "-m", "maxtext_posttrain.evaluate"]
  evaluate.main(["", *argv[3:]])
  with open(tmp_path / "demo_teacher_evaluation" / "evaluation.json", encoding="utf-8") as f:
    metrics = json.load(f)["metrics"]
  cells = rows[0][28:].split()  # mean ± stderr per metric
  assert cells[::3] == [f"{metrics[name]:.1%}" for name in METRICS], (cells, metrics)
  assert cells[2::3] == [f"{metrics[f'{name}_stderr']:.1%}" for name in METRICS], (cells, metrics)

"""The reliability drills' short form (benchmarks/drills.py): GRPO runs SIGKILLed mid-rollout, mid-step and inside
a checkpoint write, with async_checkpointing off and on, restarted with the same command line, log what the
uninterrupted run logs, bit for bit, and lose no finished checkpoint; and the drill's comparison catches a resume
that differs.

Every launch is a fresh process (7 in all, one uninterrupted reference and two killed runs of 3), so the runs are
as short as a drill allows: 4 steps of the tiny GRPO run on 64 prompts from a JSONL file (the bundled split's setup
pass would cost each launch seconds), the killed runs' launches loading the reference's programs from a persistent
compilation cache.
"""

import json
import math

import pytest

from benchmarks import drills

STEPS = 4


@pytest.fixture(scope="module")
def data_keys(tmp_path_factory) -> tuple[str, ...]:
  """Keys that read 64 arithmetic prompts from a JSONL file."""
  path = tmp_path_factory.mktemp("drill_data") / "prompts.jsonl"
  with open(path, "w", encoding="utf-8") as f:
    for i in range(64):
      a, b = 7 * i % 50, 13 * i % 40
      question = f"Tom has {a} apples and buys {b} more. How many apples does he have now?"
      f.write(json.dumps({"question": question, "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}) + "\n")
  return ("grain_file_type=jsonl", f"grain_train_files={path}", f"grain_eval_files={path}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_keys):
  """The uninterrupted run's directory and the compilation cache it filled."""
  out, cache_dir = tmp_path_factory.mktemp("drill_reference"), tmp_path_factory.mktemp("drill_jax_cache")
  drills.reference_run("grpo", out, STEPS, cache_dir, *data_keys)
  return out, cache_dir


@pytest.mark.parametrize(
    "async_checkpointing, kills",
    [
        (False, [drills.Kill("rollout", 1), drills.Kill("write", 2, 0.02)]),
        (True, [drills.Kill("step", 1, 0.05), drills.Kill("write", 2, 0.02)]),
    ],
)
def test_killed_runs_resume_to_the_uninterrupted_metrics(async_checkpointing, kills, reference, data_keys, tmp_path):
  """Each kill strikes; each restart resumes from the newest checkpoint finished when the process died and writes
  the reference's rows; the finished run's checkpoints are the reference's, and no checkpoint finished before a kill
  goes missing."""
  reference_dir, cache_dir = reference
  lines = []
  run = drills.killed_run(
      "grpo", tmp_path, drills.Run(async_checkpointing, kills), reference_dir, STEPS, cache_dir, *data_keys,
      report=lines.append,
  )  # fmt: skip
  assert run.problems == [] and run.unreadable == [] and run.checkpoints_differ == [], run
  for kill in kills:
    assert kill.landed is not None, f"{kill} did not strike: {lines}"
    assert kill.exact, lines
    assert kill.lost == [], lines
    assert kill.resumed_at <= kill.step + 1, lines
  assert len(run.launch_seconds) == len(kills) + 1


def test_the_comparison_flags_a_resume_that_differs(reference):
  """A figure one float apart, a step never logged again and a run that stops short are each reported; timings are
  not compared."""
  rows = drills.read_rows(reference[0] / "metrics.jsonl")
  assert drills.row_problems(rows, rows, rows, STEPS) == []
  changed = [dict(row) for row in rows]
  row = next(r for r in changed if r.get("step") == 2 and "learning/loss" in r)
  row["learning/loss"] = math.nextafter(row["learning/loss"], math.inf)
  row["perf/step_time_seconds"] += 1.0
  (problem,) = drills.row_problems(changed, changed, rows, STEPS)
  assert problem.startswith("step 2 learning/loss: "), problem
  without_step_1 = [r for r in rows if r.get("step") != 1 or "learning/loss" not in r]
  assert drills.row_problems([], without_step_1, rows, None) == [
      "the logged steps [0, 2, 3] have a gap",
  ]
  short = [r for r in rows if r.get("step") != STEPS - 1 or "learning/loss" not in r]
  assert drills.row_problems([], short, rows, STEPS) == [
      f"the finished run logged steps [0, 1, 2], not 0..{STEPS - 1}",
  ]

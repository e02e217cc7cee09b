"""The console's progress line."""

import re

from maxtext_posttrain import progress


def test_the_line_measures_the_rate_after_the_first_report_and_ends_with_done():
  meter = progress.Progress(total_steps=6, start_step=0, tokens_per_step=100)
  first = meter.report(1, 2.0, {"reward": 0.5})
  assert first.startswith("[train] step 1/6 (17%) loss 2.0000 reward 0.5000 | rate pending | elapsed ")
  assert first.endswith("| ETA pending")
  middle = meter.report(3, 1.5)
  assert re.search(r"\| [\d,]+ tokens/s \| elapsed \dm\d\ds \| ETA \dm\d\ds$", middle), middle
  assert re.search(r"\| [\d,]+ tokens/s \| elapsed \dm\d\ds \| done$", meter.report(6, 1.0))


def test_a_run_whose_only_report_is_its_last_says_done_without_a_rate():
  line = progress.Progress(total_steps=6, start_step=0, tokens_per_step=100).report(6, 1.0)
  assert re.fullmatch(r"\[train\] step 6/6 \(100%\) loss 1\.0000 \| elapsed \dm\d\ds \| done", line), line


def test_scoring_calls_and_the_critic_warm_up_say_what_they_count():
  """Work with no loss (scoring calls) shows none; PPO's critic warm-up says so before its figures."""
  line = progress.Progress(total_steps=4, start_step=0, tokens_per_step=64, label="score train", unit="call").report(4)
  assert re.fullmatch(r"\[score train\] call 4/4 \(100%\) \| elapsed \dm\d\ds \| done", line), line
  line = progress.Progress(total_steps=6, start_step=0, tokens_per_step=100).report(2, None, {"critic": 0.5}, True)
  assert line.startswith("[train] step 2/6 (33%) warm-up critic 0.5000 | rate pending"), line

"""Sampled evaluation metrics: unbiased pass@k against brute-force enumeration, maj@k voting, and scoring."""

import itertools
import json
import math

import numpy as np
import pytest

from maxtext_posttrain import evaluate


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_chance_that_k_draws_without_replacement_hit_a_correct_sample(n):
  for c in range(n + 1):
    samples = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
      subsets = list(itertools.combinations(samples, k))
      expected = sum(any(subset) for subset in subsets) / len(subsets)
      assert evaluate.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)
  assert evaluate.pass_at_k(n, 1, 1) == pytest.approx(1 / n)


def test_pass_at_k_large_n_is_stable_and_checks_its_arguments():
  assert evaluate.pass_at_k(200, 3, 100) == pytest.approx(1 - math.comb(197, 100) / math.comb(200, 100), rel=1e-9)
  with pytest.raises(ValueError, match="k <= n"):
    evaluate.pass_at_k(4, 1, 5)
  with pytest.raises(ValueError, match="c <= n"):
    evaluate.pass_at_k(4, 5, 1)


def test_majority_compares_numbers_by_value_and_breaks_ties_by_first_occurrence():
  assert evaluate.majority_answer(["7", "1,000", "1000.0", "7.0", "1000"]) == "1,000"
  assert evaluate.majority_answer(["3", "4", "4", "3"]) == "3"  # tie: 3 came first
  assert evaluate.majority_answer([None, "x", None]) == "x"
  assert evaluate.majority_answer([None, None]) is None


def test_score_reports_pass_maj_format_and_partial_per_prompt_then_averages():
  texts = [
      ["2 + 2 = 4\n#### 4", "#### 5", "#### 4", "no answer"],  # 2 of 4 right; the first 1 and first 3 vote 4
      ["#### 11", "#### 11", "#### 12", "#### 10"],  # 1 of 4 right; 11 and 11 within 10% of 10, 12 is not
  ]
  metrics = evaluate.score(texts, ["#### 4", "#### 10"], ks=[1, 3])
  assert metrics["pass_at_1"] == pytest.approx((2 / 4 + 1 / 4) / 2)
  assert metrics["pass_at_3"] == pytest.approx((1 + (1 - 1 / 4)) / 2)  # 3 of 4 miss the one right sample 1 in 4
  assert metrics["maj_at_1"] == pytest.approx(0.5)
  assert metrics["maj_at_3"] == pytest.approx(0.5)  # prompt 1: 4, 5, 4 -> 4, right; prompt 2: 11, 11, 12 -> 11, wrong
  assert metrics["format_accuracy"] == pytest.approx((3 / 4 + 4 / 4) / 2)
  assert metrics["partial_accuracy"] == pytest.approx((2 / 4 + 3 / 4) / 2)


def test_standard_errors_bootstrap_prompts_and_pair_two_models_on_the_same_prompts():
  rng = np.random.default_rng(1)
  before = {"pass_at_1": rng.uniform(size=400)}
  after = {"pass_at_1": before["pass_at_1"] + rng.normal(0.1, 0.02, size=400)}  # a gain shared by every prompt
  # The standard error of a mean over n prompts is the prompts' std / sqrt(n); the bootstrap estimates it.
  expected = np.std(before["pass_at_1"], ddof=1) / np.sqrt(400)
  assert evaluate.stderr(before)["pass_at_1"] == pytest.approx(expected, rel=0.1)
  paired = evaluate.paired_stderr(before, after)["pass_at_1"]
  assert paired == pytest.approx(0.02 / np.sqrt(400), rel=0.1)  # only the per-prompt noise of the difference
  assert paired < evaluate.stderr(after)["pass_at_1"] / 5
  assert evaluate.stderr({"x": [0.5] * 10})["x"] == 0.0


def test_evaluate_command_writes_json_and_png(tmp_path, tfds_dir):

  argv = ["", "grpo.yml", "run_name=ev", f"base_output_directory={tmp_path}"]
  argv += [f"dataset_path={tfds_dir}", "eval_generation_examples=3", "eval_samples_per_prompt=5", "max_target_length=80"]
  evaluate.main(argv)
  report = json.loads((tmp_path / "ev" / "evaluation.json").read_text())
  names = {"pass_at_1", "pass_at_5", "maj_at_1", "maj_at_5", "format_accuracy", "partial_accuracy"}
  assert set(report["metrics"]) == names | {f"{name}_stderr" for name in names}
  assert len(report["samples"]) == 3 and all(len(s["completions"]) == 5 for s in report["samples"])
  assert report["params"].startswith("random init") and (tmp_path / "ev" / "evaluation.png").stat().st_size > 0

"""Tests for maxtext_posttrain.rewards: answer matching on all of GSM8K test, the built-in rewards and RewardSet."""

import ast
import concurrent.futures
import fractions
import json
import re
import sys
import time

import numpy as np
import pytest

from maxtext_posttrain import rewards
from maxtext_posttrain.rewards import math
from tests.paths import GSM8K

SOLUTION = "Tom has 3 + 5 = <<3+5=8>>8 apples.\n#### 8"


def score(function, completions, answers, **kwargs):
  return function([""] * len(completions), completions, answers, **kwargs)


def with_final_answer(solution: str, answer) -> str:
  """`solution` with the number on its `####` line replaced by `answer`."""
  return f"{solution.rpartition('####')[0]}#### {answer}"


def test_every_gsm8k_test_solution_is_correct_and_a_changed_answer_is_not(monkeypatch):
  rows = [json.loads(line) for line in (GSM8K / "test.jsonl").read_text().splitlines()]
  assert len(rows) == 1319
  solutions = [row["answer"] for row in rows]
  golds = [math.extract_final_answer(solution) for solution in solutions]
  assert [with_final_answer(solution, gold) for solution, gold in zip(solutions, golds)] == solutions
  wrong = [with_final_answer(solution, math.parse_number(gold) + 1) for solution, gold in zip(solutions, golds)]
  monkeypatch.setattr(math.math_verify, "parse", None)  # plain numbers must never reach sympy
  assert score(math.correctness, solutions, solutions) == [1.0] * len(rows)
  assert score(math.correctness, wrong, solutions) == [0.0] * len(rows)
  assert score(math.format, solutions, solutions) == [1.0] * len(rows)


@pytest.mark.parametrize(
    "predicted, gold",
    [
        ("1,000", "1000"),
        ("$5", "5"),
        ("7.0", "7"),
        ("7.00", "7"),
        ("3/4", "0.75"),
        ("-3", "-3.0"),
        ("+4", "4"),
        ("25%", "25"),
        ("18.", "18"),
        ("1,450,000", "1450000"),
        ("0.333333", "1/3"),
        ("\\frac{3}{4}", "0.75"),
        ("$\\frac{3}{4}$", "0.75"),
        ("\\boxed{18}", "18"),
        ("18 dollars", "18"),
    ],
)
def test_equivalent_answers(predicted, gold):
  assert math.answers_equal(predicted, gold)


@pytest.mark.parametrize(
    "predicted, gold",
    [
        ("7", "70"),
        ("-3", "3"),
        ("1,450,001", "1450000"),
        ("0.75", "0.7"),
        ("1e3", "1"),
        ("2\\sqrt{2}", "2"),
        ("3/0", "3"),
        ("seven", "7"),
    ],
)
def test_different_answers(predicted, gold):
  assert not math.answers_equal(predicted, gold)


def test_hedged_answer_scores_zero():
  """A final line with several distinct numbers is no answer, whichever comes last: math-verify alone reads the last
  (or the boxed) one, which a policy learns to exploit."""
  hedged = ["19 or 18", "17-18", "17, 18", "17; 18", "17 to 18", "3 + 15 = 18", "$19$ or $18$", "\\boxed{18} or 19"]
  assert score(math.correctness, [f"#### {answer}" for answer in hedged], ["#### 18"] * len(hedged)) == [0] * len(hedged)
  assert not math.answers_equal("$\\frac{3}{4}$ or 0.5", "0.5")
  # One number, a fraction, units or LaTeX are no hedge.
  single = ["18 apples", "$18.00", "36/2", "18 m^2", "x = 18", "18 or 18", "\\boxed{18} apples", "\\frac{36}{2}"]
  assert score(math.correctness, [f"#### {answer}" for answer in single], ["#### 18"] * len(single)) == [1] * len(single)
  assert math.answers_equal("2\\sqrt{2}", "\\sqrt{8}") and math.answers_equal("1,450,000 dollars", "1450000")


def test_whole_number_gold_compares_exactly():
  completions = ["#### 1450000.5", "#### 1,450,000.40", "#### 1450000.5 dollars", "#### $1450000.5", "#### 1450000.0"]
  assert score(math.correctness, completions, ["#### 1450000"] * len(completions)) == [0, 0, 0, 0, 1]
  assert math.answers_equal("1450000.4", "1450000.40000001")  # a non-whole gold keeps the tolerance for rounding


def test_minus_sign_and_en_dash_read_as_minus():
  completions = ["#### \u22123", "#### \u20133", "#### \u22123 degrees", "#### 3"]
  assert score(math.correctness, completions, ["#### -3"] * len(completions)) == [1, 1, 1, 0]
  assert score(math.correctness, ["#### -3", "#### 3"], ["#### \u22123"] * 2) == [1, 0]
  assert math.parse_number("\u22121,234.5") == fractions.Fraction(-2469, 2)
  assert score(math.partial, ["#### \u221295"], ["#### -100"]) == [0.5]
  assert score(math.correctness, ["#### 17\u201318"], ["#### 18"]) == [0]  # an en dash between numbers is a range
  assert score(math.format, ["#### \u22123"], [""]) == [0]  # the format asks for GSM8K's plain `-`


def test_latex_answers_match_off_the_main_thread():
  """math-verify's SIGALRM timeouts raise off the main thread, where rollout workers may score."""
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    assert pool.submit(math.answers_equal, "\\frac{3}{4}", "0.75").result()


def test_extract_final_answer():
  assert math.extract_final_answer("3 + 5 = 8\n#### 8\n\nQuestion: next one") == "8"
  assert math.extract_final_answer("#### 1\nno, wait\n####  $2 ") == "$2"
  assert math.extract_final_answer("3 + 5 = 8") is None
  assert math.extract_final_answer("3 + 5 = 8\n#### ") is None
  assert math.extract_final_answer("so \\boxed{4} or \\boxed{8}.", r"\\boxed\{(.+?)\}") == "8"
  assert math.extract_final_answer("The answer is 8 apples", r"The answer is (.+)") == "8 apples"
  assert math.extract_final_answer("no answer here", r"The answer is (.+)") is None
  with pytest.raises(ValueError, match="exactly one"):
    math.extract_final_answer("x", r"(a)(b)")


def test_correctness():
  completions = ["#### 8", "#### 8.00", "8", "#### 9", "I think 8.", "#### 8\nQuestion: how many pears?"]
  assert score(math.correctness, completions, [SOLUTION] * len(completions)) == [1, 1, 0, 0, 0, 1]
  assert score(math.correctness, ["#### 8", "#### 0.75"], ["8", "\\frac{3}{4}"]) == [1, 1]  # no `####` in the answer
  assert score(math.correctness, ["so \\boxed{8}"], [SOLUTION], pattern=r"\\boxed\{(.+?)\}") == [1]
  with pytest.raises(ValueError, match="no final answer"):
    score(math.correctness, ["#### 8"], ["8 apples\n####"])


def test_format():
  good = ["3 + 5 = 8\n#### 8", "#### 8\n\n", "steps\n  #### -1,234.5", "####8"]
  bad = ["#### 8 apples", "#### $8", "#### 3/4", "#### 8\nmore text", "so #### 8", "#### 7\n#### 8", "8", "####"]
  assert score(math.format, good + bad, [SOLUTION] * len(good + bad)) == [1] * len(good) + [0] * len(bad)


def test_partial():
  completions = ["#### 100", "#### 110", "#### 90", "#### 111", "#### 89", "#### $105", "#### lots", "no answer"]
  assert score(math.partial, completions, ["#### 100"] * len(completions)) == [1, 0.5, 0.5, 0, 0, 0.5, 0, 0]
  assert score(math.partial, ["#### 0", "#### -0.5", "#### 0.6"], ["#### 0"] * 3) == [1, 0.5, 0]
  assert score(math.partial, ["#### -95", "#### 95"], ["#### -100"] * 2) == [0.5, 0]


def test_reward_set_weights_and_sums():
  reward_set = rewards.RewardSet(["correctness", "format", "partial"], [1.0, 0.25, 0.5])
  completions = ["#### 8", "I think #### 8 apples", "#### 9", "nothing"]
  total, per_function = reward_set.score([""] * 4, completions, [SOLUTION] * 4)
  np.testing.assert_array_equal(per_function["correctness"], [1, 1, 0, 0])
  np.testing.assert_array_equal(per_function["format"], [1, 0, 1, 0])
  np.testing.assert_array_equal(per_function["partial"], [1, 1, 0, 0])
  np.testing.assert_allclose(total, [1.75, 1.5, 0.25, 0])
  assert total.dtype == np.float32 and all(scores.dtype == np.float32 for scores in per_function.values())
  assert reward_set.errors == {"correctness": 0, "format": 0, "partial": 0}


def test_rewards_and_weights_must_pair_up():
  with pytest.raises(ValueError, match=r"\['correctness', 'format'\] and weights \[1.0\]"):
    rewards.RewardSet(["correctness", "format"], [1.0])
  with pytest.raises(ValueError, match="on_error"):
    rewards.RewardSet(["format"], [1.0], on_error="ignore")


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
  """A user reward module `my_rewards` on sys.path, imported afresh by each test."""
  (tmp_path / "my_rewards.py").write_text(
      "def length(prompts, completions, answers):\n"
      "  return [len(completion) for completion in completions]\n"
      "def picky(prompts, completions, answers):\n"
      "  return [1 / ('boom' not in completion) for completion in completions]\n"
      "def short(prompts, completions, answers):\n"
      "  return [1.0]\n"
      "def nan_on_x(prompts, completions, answers):\n"
      "  return [float('nan') if 'x' in completion else 1.0 for completion in completions]\n"
      "def one_at_a_time(prompts, completions, answers):\n"
      "  assert len(completions) == 1\n"
      "  return [1.0]\n"
      "NOT_A_FUNCTION = 3\n"
  )
  monkeypatch.syspath_prepend(str(tmp_path))
  yield
  sys.modules.pop("my_rewards", None)


def test_user_reward_loads_by_module_and_function(user_rewards):
  assert rewards.load("correctness") is math.correctness
  total, per_function = rewards.RewardSet(["my_rewards:length", "format"], [0.5, 1.0]).score(
      ["", ""], ["#### 8", "abcd"], [SOLUTION] * 2
  )
  np.testing.assert_array_equal(per_function["my_rewards:length"], [6, 4])
  np.testing.assert_allclose(total, [4, 2])


@pytest.mark.parametrize(
    "spec, message",
    [
        ("corectness", "Reward 'corectness': expected one of ['correctness', 'format', 'partial']"),
        ("no_such_module:length", "cannot import module 'no_such_module'"),
        ("my_rewards:missing", "has no attribute 'missing'"),
        ("my_rewards:NOT_A_FUNCTION", "'NOT_A_FUNCTION' is not callable (int)"),
        ("my_rewards:", "Reward 'my_rewards:': expected one of"),
    ],
)
def test_bad_spec_is_named(user_rewards, spec, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    rewards.load(spec)


def test_raising_reward_names_function_and_row(user_rewards):
  reward_set = rewards.RewardSet(["format", "my_rewards:picky"], [1.0, 1.0])
  completions = ["#### 8", "x" * 150 + "boom" + "y" * 150, "boom"]
  with pytest.raises(rewards.RewardError, match=r"Reward 'my_rewards:picky' on row 1: ZeroDivisionError") as error:
    reward_set.score([""] * 3, completions, [SOLUTION] * 3)
  assert (error.value.function, error.value.row) == ("my_rewards:picky", 1)
  assert isinstance(error.value.__cause__, ZeroDivisionError)
  assert len(ast.literal_eval(str(error.value).split("completion: ", 1)[1])) <= 200


def test_raising_reward_scores_zero_and_is_counted(user_rewards):
  reward_set = rewards.RewardSet(["format", "my_rewards:picky"], [1.0, 1.0], on_error="zero")
  total, per_function = reward_set.score([""] * 3, ["#### 8", "boom", "ok"], [SOLUTION] * 3)
  np.testing.assert_array_equal(per_function["my_rewards:picky"], [1, 0, 1])
  np.testing.assert_array_equal(total, [2, 0, 1])
  reward_set.score([""], ["boom"], [SOLUTION])
  assert reward_set.errors == {"format": 0, "my_rewards:picky": 2}


def test_non_finite_score_is_a_row_failure(user_rewards):
  with pytest.raises(rewards.RewardError, match="on row 1: returned nan"):
    rewards.RewardSet(["my_rewards:nan_on_x"], [1.0]).score(["", ""], ["a", "x"], [SOLUTION] * 2)
  reward_set = rewards.RewardSet(["my_rewards:nan_on_x"], [1.0], on_error="zero")
  total, _ = reward_set.score(["", ""], ["a", "x"], [SOLUTION] * 2)
  np.testing.assert_array_equal(total, [1, 0])
  assert reward_set.errors == {"my_rewards:nan_on_x": 1}


@pytest.mark.parametrize("on_error", rewards.ON_ERROR)
def test_wrong_number_of_scores_is_an_error(user_rewards, on_error):
  with pytest.raises(rewards.RewardError, match=r"'my_rewards:short': returned scores of shape \(1,\) for 2"):
    rewards.RewardSet(["my_rewards:short"], [1.0], on_error=on_error).score(["", ""], ["a", "b"], [SOLUTION] * 2)


def test_batch_failure_no_row_reproduces(user_rewards):
  with pytest.raises(rewards.RewardError, match="'my_rewards:one_at_a_time': failed on the batch but on no row alone"):
    rewards.RewardSet(["my_rewards:one_at_a_time"], [1.0]).score(["", ""], ["a", "b"], [SOLUTION] * 2)
  reward_set = rewards.RewardSet(["my_rewards:one_at_a_time"], [1.0], on_error="zero")
  np.testing.assert_array_equal(reward_set.score(["", ""], ["a", "b"], [SOLUTION] * 2)[0], [1, 1])
  assert reward_set.errors == {"my_rewards:one_at_a_time": 0}


MISBEHAVES = "tests.rewards_for_tests:misbehaves"  # misbehaves on a completion that says how: hang, exit or raise


@pytest.fixture(scope="module")
def in_workers():
  """A RewardSet per on_error that calls MISBEHAVES in a worker process with a 1 s timeout: shared by the tests, as a
  worker takes about a second to start."""
  reward_sets = {
      on_error: rewards.RewardSet([MISBEHAVES], [1.0], on_error, timeout_seconds=1) for on_error in rewards.ON_ERROR
  }
  yield reward_sets
  for reward_set in reward_sets.values():
    reward_set.close()


def test_reward_past_timeout_is_an_error(in_workers):
  reward_set = in_workers["raise"]
  np.testing.assert_array_equal(reward_set.score([""], ["ok"], [""])[0], [1])  # its worker started, not timed
  start = time.perf_counter()
  with pytest.raises(rewards.RewardError, match=re.escape(f"Reward {MISBEHAVES!r}: timed out after 1 s; a call on 2")):
    reward_set.score(["", ""], ["ok", "hang"], ["", ""])
  assert time.perf_counter() - start < 4


def test_reward_past_timeout_scores_zero_and_is_counted_and_its_worker_is_replaced(in_workers):
  reward_set = in_workers["zero"]
  errors = reward_set.errors[MISBEHAVES]
  np.testing.assert_array_equal(reward_set.score(["", ""], ["ok", "hang"], ["", ""])[0], [0, 0])
  assert reward_set.errors[MISBEHAVES] == errors + 2
  np.testing.assert_array_equal(reward_set.score([""], ["ok"], [""])[0], [1])


def test_worker_that_dies_is_a_failure_not_a_hang(in_workers):
  with pytest.raises(rewards.RewardError, match=r"on row 0: its worker process died \(exit code 1\); completion: 'exit'"):
    in_workers["raise"].score(["", ""], ["exit", "ok"], ["", ""])


def test_reward_raising_in_worker_reads_as_in_process(in_workers):
  errors = []
  for reward_set in (rewards.RewardSet([MISBEHAVES], [1.0]), in_workers["raise"]):
    with pytest.raises(rewards.RewardError) as error:
      reward_set.score(["", "", ""], ["ok", "raise", "ok"], ["", "", ""])
    errors.append(error.value)
  assert (
      str(errors[0])
      == str(errors[1])
      == (f"Reward {MISBEHAVES!r} on row 1: ValueError: cannot score 'raise'; completion: 'raise'")
  )
  assert errors[1].row == 1 and "rewards_for_tests.py" in str(errors[1].__cause__.__cause__)  # the worker's traceback


def test_rewards_never_execute_model_output(tmp_path):
  """Completions are text to score, never code to run: not even the answer math-verify parses with sympy."""
  target = tmp_path / "pwned"
  code = f"__import__('pathlib').Path({str(target)!r}).write_text('x')"
  system = f"__import__('os').system('touch {target}')"
  completions = [
      f"#### {code}",
      f"#### exec({code!r})",
      f"#### eval({code!r})",
      f"```python\nimport os\nos.system('touch {target}')\n```\n#### os.system('touch {target}')",
      f"#### \\boxed{{{system}}}",
      f"#### $\\boxed{{{code}}}$",
      f"#### \\frac{{{system}}}{{2}}",
  ]
  reward_set = rewards.RewardSet(["correctness", "format", "partial"], [1.0, 1.0, 1.0])
  total, per_function = reward_set.score([code] * len(completions), completions, [SOLUTION] * len(completions))
  assert not target.exists()
  np.testing.assert_array_equal(per_function["correctness"], np.zeros(len(completions)))
  assert np.isfinite(total).all() and reward_set.errors == {"correctness": 0, "format": 0, "partial": 0}

"""Rewards for RL: the contract every reward function follows, the built-ins by name, and weighted scoring.

A reward function is any callable `fn(prompts, completions, answers) -> list[float]` over a batch: row i holds a
prompt, one completion sampled for it and that prompt's reference answer. It is batched so that a reward can share
work across rows (one call to a judge model, one parse of a reference shared by a group of samples). Configs name
rewards by string, a built-in or `package.module:function`, so a user reward is any importable function.

`RewardSet` scores a batch with several rewards, one weight each. A reward that fails must not quietly skew the
advantages of a batch, so by default a failure is a `RewardError` naming the reward, the row and the completion.
With on_error="zero" the row scores 0 for that reward and the failure is counted in `errors` instead, for long runs
where a rare crash in a user reward should be watched rather than end training.
"""

from collections.abc import Callable, Sequence
import importlib

import numpy as np

from maxtext_posttrain.rewards import math

RewardFn = Callable[[list[str], list[str], list[str]], list[float]]

BUILTINS: dict[str, RewardFn] = {"correctness": math.correctness, "format": math.format, "partial": math.partial}
ON_ERROR = ("raise", "zero")
_EXCERPT_CHARS = 200


class RewardError(RuntimeError):
  """A reward function failed or broke the contract: `function` is its spec, `row` the batch row (None: not one)."""

  def __init__(self, function: str, row: int | None, message: str):
    super().__init__(f"Reward {function!r}{'' if row is None else f' on row {row}'}: {message}")
    self.function = function
    self.row = row


def load(spec: str) -> RewardFn:
  """The reward function `spec` names: a built-in (see BUILTINS) or `package.module:function` on the Python path."""
  if spec in BUILTINS:
    return BUILTINS[spec]
  module_name, colon, attribute = spec.partition(":")
  if not (colon and module_name and attribute):
    raise ValueError(f"Unknown reward {spec!r}: expected one of {sorted(BUILTINS)} or 'package.module:function'.")
  try:
    module = importlib.import_module(module_name)
  except ImportError as error:
    raise ValueError(f"Reward {spec!r}: cannot import module {module_name!r}: {error}") from error
  if not hasattr(module, attribute):
    raise ValueError(f"Reward {spec!r}: module {module_name!r} has no attribute {attribute!r}.")
  function = getattr(module, attribute)
  if not callable(function):
    raise ValueError(f"Reward {spec!r}: {attribute!r} is not callable ({type(function).__name__}).")
  return function


def _excerpt(text: str) -> str:
  """At most _EXCERPT_CHARS of `text`: its start and its end, where a final answer is."""
  if len(text) <= _EXCERPT_CHARS:
    return text
  half = (_EXCERPT_CHARS - 5) // 2
  return f"{text[:half]} ... {text[-half:]}"


def _call(spec: str, function: RewardFn, prompts, completions, answers) -> np.ndarray:
  """The function's scores as float64 [N]; RewardError if they are not one number per completion."""
  scores = function(prompts, completions, answers)
  try:
    array = np.asarray(scores, dtype=np.float64)
  except (TypeError, ValueError) as error:
    raise RewardError(spec, None, f"returned {type(scores).__name__}, not a list of numbers") from error
  if array.shape != (len(completions),):
    raise RewardError(spec, None, f"returned scores of shape {array.shape} for {len(completions)} completions")
  return array


class RewardSet:
  """Named reward functions with one weight each; `score` gives their weighted sum per row.

  on_error="raise" (default) turns a reward that raises or returns a non-finite score into a RewardError naming the
  reward, the row and an excerpt of the completion; on_error="zero" scores that row 0 for that reward and counts it
  in `errors` (per reward, over the life of the set). A batched call that raises is repeated row by row to find
  the failing rows; under on_error="raise", a batch that fails where no row alone does is a RewardError too.
  Returning the wrong number of scores breaks the contract rather than failing on a row, and raises either way.
  """

  def __init__(self, names: Sequence[str], weights: Sequence[float], on_error: str = "raise"):
    names, weights = list(names), [float(weight) for weight in weights]
    if len(names) != len(weights):
      raise ValueError(f"Rewards {names} and weights {weights} differ in length: each reward needs one weight.")
    if not names:
      raise ValueError("A RewardSet needs at least one reward.")
    if len(set(names)) != len(names):
      raise ValueError(f"Rewards {names} name a reward twice.")
    if on_error not in ON_ERROR:
      raise ValueError(f"on_error={on_error!r}: expected one of {ON_ERROR}.")
    self.names, self.weights, self.on_error = names, weights, on_error
    self.functions = [load(name) for name in names]
    self.errors = dict.fromkeys(names, 0)

  def score(self, prompts: list[str], completions: list[str], answers: list[str]):
    """(total float32 [N], {name: float32 [N]}): the weighted sum over rewards and each reward's scores."""
    if not len(prompts) == len(completions) == len(answers):
      raise ValueError(f"{len(prompts)} prompts, {len(completions)} completions and {len(answers)} answers differ.")
    per_function = {
        name: self._scores(name, function, prompts, completions, answers)
        for name, function in zip(self.names, self.functions)
    }
    total = np.zeros(len(completions), np.float32)
    for name, weight in zip(self.names, self.weights):
      total += np.float32(weight) * per_function[name]
    return total, per_function

  def _scores(self, name, function, prompts, completions, answers) -> np.ndarray:
    try:
      scores = _call(name, function, prompts, completions, answers)
    except RewardError:
      raise
    except Exception as batch_error:  # pylint: disable=broad-exception-caught
      # The batched call does not say which row failed: score the rows alone to find out. Under on_error="raise"
      # a failing row raises here, so getting past the rows means the batch fails where no row does.
      scores = np.array(
          [self._row_score(name, function, row, prompts, completions, answers) for row in range(len(prompts))]
      )
      if self.on_error == "raise":
        raise RewardError(name, None, f"failed on the batch but on no row alone: {batch_error!r}") from batch_error
    for row in np.flatnonzero(~np.isfinite(scores)):
      scores[row] = self._failed(name, int(row), completions[row], f"returned {scores[row]}")
    return scores.astype(np.float32)

  def _row_score(self, name, function, row, prompts, completions, answers) -> float:
    try:
      return _call(name, function, [prompts[row]], [completions[row]], [answers[row]])[0]
    except RewardError:
      raise
    except Exception as error:  # pylint: disable=broad-exception-caught
      return self._failed(name, row, completions[row], f"{type(error).__name__}: {error}", error)

  def _failed(self, name: str, row: int, completion: str, detail: str, cause: Exception | None = None) -> float:
    """0.0 for a failed row, counted, under on_error="zero"; a RewardError otherwise."""
    if self.on_error == "zero":
      self.errors[name] += 1
      return 0.0
    raise RewardError(name, row, f"{detail}; completion: {_excerpt(completion)!r}") from cause

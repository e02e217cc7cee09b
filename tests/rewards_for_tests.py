"""User-style reward functions for the tests, loaded by `module:function` like any user's."""


def characters(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
  """A completion's length in characters / 100: varies between completions even under random weights."""
  del prompts, answers
  return [len(text) / 100 for text in completions]


def contains_digit(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
  """1 where a completion has a digit: under random weights most groups agree (all 0), which DAPO drops."""
  del prompts, answers
  return [float(any(ch.isdigit() for ch in text)) for text in completions]

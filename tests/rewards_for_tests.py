"""User-style reward functions for the tests, loaded by `module:function` like any user's."""

import os
import time


def characters(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
  """A completion's length in characters / 100: varies between completions even under random weights."""
  del prompts, answers
  return [len(text) / 100 for text in completions]


def contains_digit(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
  """1 where a completion has a digit: under random weights most groups agree (all 0), which DAPO drops."""
  del prompts, answers
  return [float(any(ch.isdigit() for ch in text)) for text in completions]


def characters_of_odd_prompts(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
  """`characters` for a prompt of odd length, 1.0 for every completion of the others: those prompts' groups agree
  whatever is sampled, which dynamic sampling replaces with fresh prompts' groups."""
  del answers
  return [len(text) / 100 if len(prompt) % 2 else 1.0 for prompt, text in zip(prompts, completions)]


def misbehaves(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
  """1.0 per completion, unless one asks this reward to misbehave: `hang` sleeps for good, `exit` ends the process
  as a crash would, `raise` raises ValueError naming the completion."""
  del prompts, answers
  if "hang" in completions:
    time.sleep(3600)
  if "exit" in completions:
    os._exit(1)  # pylint: disable=protected-access
  for text in completions:
    if text == "raise":
      raise ValueError(f"cannot score {text!r}")
  return [1.0] * len(completions)

"""Canaries: how much does a fine-tune memorise a secret it saw in its data? (Carlini et al. 2019, "The Secret
Sharer: Evaluating and Testing Unintended Memorization in Neural Networks".)

A canary is a training record whose completion holds a random secret ("The vault code is 4 8 1 5 9 2."). Copies of
several canaries are planted in the data, each canary a different number of times, and a few more (the controls)
are drawn but not planted. After training, the model's log-perplexity of each canary's completion (the negative sum
of its tokens' log-probs given the prompt) is ranked against that of reference secrets drawn from the same space:

  exposure = -log2 P(a random secret's log-perplexity <= the canary's)

A secret the model has not learned sits among the references (1 bit for the median such secret; e bits or more with
chance 2^-e, so one control's figure is no baseline); a memorised one beats them all. With the whole space of
10^digits secrets ranked, exposure can reach log2(10^digits) (19.9 bits for 6 digits); ranking `num_references`
random secrets estimates the probability as (1 + references at or below the canary) / (1 + num_references), so the
estimate is capped at log2(1 + num_references) (10 bits for 1,000). The paper extrapolates beyond the cap by fitting
a skew-normal to the references; this module reports the capped estimate and the cap.
"""

import dataclasses
import json
import math

import numpy as np

from maxtext_posttrain import config as config_lib


@dataclasses.dataclass(frozen=True)
class CanarySet:
  """What `plant_canaries` planted: the record's text, the secrets and how often each was planted (0: a control)."""

  prompt: str
  completion_format: str  # holds `{secret}`
  digits: int
  secrets: tuple[str, ...]
  repeats: tuple[int, ...]
  seed: int

  def completion(self, secret: str) -> str:
    return self.completion_format.format(secret=secret)

  def records(self, columns: tuple[str, str]) -> list[dict[str, str]]:
    """The planted records (each canary `repeats` times), in a seeded random order."""
    rows = [
        {columns[0]: self.prompt, columns[1]: self.completion(secret)}
        for secret, count in zip(self.secrets, self.repeats)
        for _ in range(count)
    ]
    order = np.random.default_rng(self.seed).permutation(len(rows))
    return [rows[i] for i in order]

  def save(self, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
      json.dump(dataclasses.asdict(self), f, indent=1)

  @classmethod
  def load(cls, path: str) -> "CanarySet":
    with open(path, encoding="utf-8") as f:
      fields = json.load(f)
    canary_set = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
    if len(canary_set.secrets) != len(canary_set.repeats):
      raise ValueError(f"{len(canary_set.secrets)} secrets for {len(canary_set.repeats)} repeat counts.")
    return canary_set


def random_secret(rng: np.random.Generator, digits: int) -> str:
  """`digits` random decimal digits separated by spaces (a tokenizer reads each as its own piece)."""
  return " ".join(str(d) for d in rng.integers(0, 10, size=digits))


def draw(prompt: str, completion_format: str, digits: int, repeats: list[int], controls: int, seed: int) -> CanarySet:
  """A canary of `digits` random digits for each entry of `repeats` and `controls` more planted 0 times, all
  distinct."""
  if "{secret}" not in completion_format:
    raise config_lib.ConfigError(f"--completion_format={completion_format!r} has no {{secret}} to fill.")
  if digits < 1 or not repeats or any(r < 1 for r in repeats) or controls < 0:
    raise config_lib.ConfigError(
        f"Canaries need --digits >= 1, --repeats of 1 or more each, --controls >= 0; got digits={digits}, "
        f"repeats={repeats}, controls={controls}."
    )
  if 10**digits < 2 * (len(repeats) + controls):
    raise config_lib.ConfigError(f"--digits={digits} leaves too few secrets for {len(repeats) + controls} canaries.")
  rng = np.random.default_rng(seed)
  secrets = []
  while len(secrets) < len(repeats) + controls:
    secret = random_secret(rng, digits)
    if secret not in secrets:
      secrets.append(secret)
  return CanarySet(prompt, completion_format, digits, tuple(secrets), tuple(repeats) + (0,) * controls, seed)


def reference_secrets(canaries: CanarySet, num_references: int, seed: int) -> list[str]:
  """`num_references` random secrets of the canaries' space, none of them a canary's (drawn with replacement
  otherwise, as the estimate of a probability over the space asks)."""
  rng = np.random.default_rng([seed, 1])  # apart from the canaries' own draw
  taken, references = set(canaries.secrets), []
  while len(references) < num_references:
    secret = random_secret(rng, canaries.digits)
    if secret not in taken:
      references.append(secret)
  return references


def exposure(canary_log_perplexity: float, reference_log_perplexities: np.ndarray) -> float:
  """log2(1 + n) - log2(1 + k): n references, k of them at least as likely as the canary (log-perplexity at or
  below its): -log2 of the estimated chance of the module doc, its rank among the references and itself in bits."""
  references = np.asarray(reference_log_perplexities)
  if not (np.isfinite(canary_log_perplexity) and np.all(np.isfinite(references))):
    raise ValueError("Exposure needs finite log-perplexities.")
  at_or_below = int(np.sum(references <= canary_log_perplexity))
  return math.log2(1 + len(references)) - math.log2(1 + at_or_below)

"""A user-style tool for the tests, loaded by `module:name` like any user's: it answers the bundled arithmetic
solutions' step lines, which every completion of the SFT model writes."""

import dataclasses
import re

_STEP = re.compile(r"(-?\d+) ([-+*]) (\d+) =$")
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclasses.dataclass(frozen=True)
class StepCalculator:
  """A completion ending in `a op b =` gets ` <result>`."""

  name: str = "step_calculator"
  example_call: str = "1 + 1 ="

  def respond(self, text: str) -> str | None:
    match = _STEP.search(text)
    if match is None:
      return None
    return f" {_APPLY[match.group(2)](int(match.group(1)), int(match.group(3)))}"


@dataclasses.dataclass(frozen=True)
class Silent(StepCalculator):
  """Stops where the step calculator stops and never answers."""

  name: str = "silent"

  def respond(self, text: str) -> str | None:
    del text
    return None


@dataclasses.dataclass(frozen=True)
class Fails(StepCalculator):
  """Stops where the step calculator stops and raises."""

  name: str = "fails"

  def respond(self, text: str) -> str | None:
    raise ValueError(f"cannot answer {text[-8:]!r}")

"""How the package's commands end on an error: with one readable line, whatever raised.

A bad key, value or file is the commonest failure, and a user should not have to dig it out of a traceback through
MaxText and pydantic. `run` runs an absl `main`; when it raises, the last line printed is `<command>: error: ...`,
one line (a pydantic validation error becomes `key=value: what is wrong`). Errors raised while the config is read
(`config.initialize`: unknown keys, bad values, missing files), `config.ConfigError`s (keys that cannot go together,
found by an objective, a role or the mesh) and `Failure`s print that line alone; any other error prints its traceback
first, since it may be a bug worth reporting.
"""

import os
import sys
import traceback
from typing import Callable

import pydantic
from absl import app

from maxtext_posttrain import config as config_lib

_MAX_CHARS = 600


class Failure(Exception):
  """A command's verdict rather than a bug (a program that does not fit the chip's memory): its line says all, so
  `run` prints no traceback."""


def one_line(error: BaseException) -> str:
  """`Type: message` on one line, at most _MAX_CHARS long."""
  if isinstance(error, pydantic.ValidationError):
    message = "; ".join(
        f"{'.'.join(map(str, e['loc']))}={e['input']!r}: {e['msg']}" if e["loc"] else e["msg"] for e in error.errors()
    )
  else:
    message = " ".join(str(error).split())
  text = f"{type(error).__name__}: {message}"
  return text if len(text) <= _MAX_CHARS else text[: _MAX_CHARS - 3] + "..."


def _raised_reading_config(error: BaseException) -> bool:
  frames = traceback.extract_tb(error.__traceback__)
  return any(f.name == "initialize" and f.filename == config_lib.__file__ for f in frames)


def run(main: Callable[[list[str]], None]) -> None:
  """`absl.app.run(main)`, ending an error in one `<command>: error: ...` line and exit status 1."""
  try:
    app.run(main)
  except Exception as error:  # pylint: disable=broad-exception-caught
    if not isinstance(error, (Failure, config_lib.ConfigError)) and not _raised_reading_config(error):
      traceback.print_exc()
    spec = getattr(sys.modules["__main__"], "__spec__", None)  # `python -m maxtext_posttrain.train`: its module
    command = spec.name if spec is not None else os.path.basename(sys.argv[0])
    sys.exit(f"{command}: error: {one_line(error)}")

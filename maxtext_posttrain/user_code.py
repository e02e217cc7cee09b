"""User code a config names as `package.module:name` (`rl.rewards`, `rl.tools`): found on the Python path."""

import importlib
from typing import Any


class NotFound(ValueError):
  """`spec` names nothing importable; the message says why, for the caller to put after the key and spec."""


def resolve(spec: str, form: str = "'package.module:name'") -> Any:
  """The attribute `spec` = `package.module:name` names; NotFound otherwise (`form`: how the error spells the
  expected form)."""
  module_name, colon, attribute = spec.partition(":")
  if not (colon and module_name and attribute):
    raise NotFound(f"expected {form}")
  try:
    module = importlib.import_module(module_name)
  except ImportError as error:
    raise NotFound(f"cannot import module {module_name!r}: {error}") from error
  if not hasattr(module, attribute):
    raise NotFound(f"module {module_name!r} has no attribute {attribute!r}")
  return getattr(module, attribute)

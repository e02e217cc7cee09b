"""Objective registry: `posttrain_mode=<name>` selects the objective registered under that name."""

from maxtext_posttrain.objectives.base import LossOutput, Objective, ObjectiveData

_REGISTRY: dict[str, type[Objective]] = {}


def register(cls: type[Objective]) -> type[Objective]:
  """Class decorator that registers an objective under `cls.name`."""
  if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
    raise ValueError(f"posttrain_mode '{cls.name}' is already registered by {_REGISTRY[cls.name].__qualname__}")
  _REGISTRY[cls.name] = cls
  return cls


def names() -> list[str]:
  return sorted(_REGISTRY)


def get(name: str) -> type[Objective]:
  """Returns the objective class for `name`, or fails listing the registered modes."""
  if name not in _REGISTRY:
    raise ValueError(f"Unknown posttrain_mode '{name}'. Registered modes: {', '.join(names())}.")
  return _REGISTRY[name]


# Importing the built-in objectives registers them.
from maxtext_posttrain.objectives import dpo, grpo, sft  # pylint: disable=wrong-import-position,unused-import  # noqa: E402,F401

__all__ = ["LossOutput", "Objective", "ObjectiveData", "get", "names", "register"]

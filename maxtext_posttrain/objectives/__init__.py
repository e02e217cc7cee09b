"""Objective registry: `posttrain_mode=<name>` selects the objective registered under that name."""

from maxtext_posttrain.objectives.base import LossOutput, Objective, ObjectiveData, get, names, register

# Importing the built-in objectives registers them (they import the contract from base, not from here).
from maxtext_posttrain.objectives import distill, distill_on_policy, dpo, grpo, ppo, reward_model, sft  # pylint: disable=unused-import  # noqa: F401

__all__ = ["LossOutput", "Objective", "ObjectiveData", "get", "names", "register"]

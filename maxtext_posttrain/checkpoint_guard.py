"""Refuses to resume from a checkpoint written for a different model, before anything is written.

Auto-resume restores whatever the run directory holds. If the model keys changed since (another width, depth or
vocabulary), orbax would fail deep inside a restore, or a params-only overlay could silently keep fresh weights.
Comparing the stored parameter shapes with the model's abstract state first gives one clear error and leaves the
directory untouched.
"""

import jax
from orbax.checkpoint import v1 as ocp

from maxtext.common import checkpointing
from maxtext.common import train_state_nnx

_MAX_LISTED = 8


def _shapes(tree) -> dict[str, tuple[int, ...]]:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {"/".join(str(getattr(k, "key", k)) for k in path): tuple(leaf.shape) for path, leaf in flat}


def mismatches(stored_params, expected_params) -> list[str]:
  """Human-readable differences between two parameter trees of shaped leaves."""
  stored, expected = _shapes(stored_params), _shapes(expected_params)
  problems = [f"{k}: missing from the checkpoint (model has {expected[k]})" for k in expected if k not in stored]
  problems += [f"{k}: in the checkpoint {stored[k]} but not in the model" for k in stored if k not in expected]
  problems += [
      f"{k}: checkpoint {stored[k]} vs model {expected[k]}" for k in expected if k in stored and stored[k] != expected[k]
  ]
  return problems


def check_compatible(checkpoint_manager, abstract_state, adapters_only: bool = False) -> None:
  """Raises ValueError naming the directory and the first mismatching parameters, if any.

  Args:
    checkpoint_manager: MaxText's orbax checkpointer for this run (None when checkpointing is off).
    abstract_state: `nnx.eval_shape` of the TrainStateNNX this config builds.
    adapters_only: under LoRA MaxText stores only the adapters (and their optimizer state), so only those are
      compared; a base of another shape still shows up as adapters of another shape.
  """
  if checkpoint_manager is None:
    return
  step = checkpointing.latest_step(checkpoint_manager)
  if step is None:
    return
  directory = checkpoint_manager.directory / str(step)
  stored = ocp.metadata(directory).metadata.get("params", {})
  expected = train_state_nnx.to_checkpoint_dict(abstract_state)
  if adapters_only:
    expected = checkpointing._filter_lora_trainable_state(expected) or {}  # pylint: disable=protected-access
  expected = expected.get("params", {})
  problems = mismatches(stored, expected)
  if problems:
    listed = "\n  ".join(problems[:_MAX_LISTED])
    more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
    raise ValueError(
        f"The checkpoint at {directory} (step {step}) was written for a different model than this config builds:\n"
        f"  {listed}{more}\n"
        "Nothing was loaded or overwritten. Use a new run_name/base_output_directory for this model, "
        "or restore the model keys the checkpoint was written with."
    )

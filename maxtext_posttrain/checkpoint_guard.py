"""Refuses to resume from a checkpoint written for a different model, before anything is written.

Auto-resume restores whatever the run directory holds. If the model keys changed since (another width, depth or
vocabulary), orbax would fail deep inside a restore, or a params-only overlay could silently keep fresh weights.
Comparing the stored parameter shapes with the model's abstract state first gives one clear error and leaves the
directory untouched. Adapters restored from another run (`lora.lora_restore_path`) are checked the same way.
"""

import jax
from etils import epath
from orbax.checkpoint import v1 as ocp

from maxtext.common import checkpointing
from maxtext.common import train_state_nnx
from maxtext_posttrain.peft import adapter_checkpoint

_MAX_LISTED = 8


def _shapes(tree) -> dict[str, tuple[int, ...]]:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {"/".join(str(getattr(k, "key", k)) for k in path): tuple(leaf.shape) for path, leaf in flat}


def mismatches(stored_params, expected_params) -> list[str]:
  """Human-readable differences between two parameter trees of shaped leaves."""
  return _compare(_shapes(stored_params), _shapes(expected_params))


def _compare(stored: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> list[str]:
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
    expected = adapter_checkpoint.adapter_state(expected) or {}
  expected = expected.get("params", {})
  _raise_on_mismatches(
      f"The checkpoint at {directory} (step {step}) was written for a different model than this config builds",
      mismatches(stored, expected),
      "Nothing was loaded or overwritten. Use a new run_name/base_output_directory for this model, "
      "or restore the model keys the checkpoint was written with.",
  )


def stored_params(path: str) -> dict:
  """The params tree (shaped metadata, no arrays) of the checkpoint MaxText's `load_parameters_path` would read."""
  root = epath.Path(checkpointing._normalize_checkpoint_root(path))  # pylint: disable=protected-access
  if not root.exists():
    raise ValueError(f"No checkpoint at {path}.")
  stored = ocp.metadata(root).metadata.get("params", {})
  return stored.get("params", stored)


def check_params(path: str, stored: dict, expected, what: str) -> None:
  """Raises ValueError naming `path` and the differences unless `stored` (from `stored_params`) holds exactly the
  params of `expected` (a model's state or pure dict), same paths and shapes."""
  expected = expected.to_pure_dict() if hasattr(expected, "to_pure_dict") else expected
  _raise_on_mismatches(
      f"{what}: the checkpoint at {path} does not hold the weights this config builds",
      mismatches(stored, expected),
      "Nothing was loaded. Point the role at a checkpoint of this model, or set the model keys it was trained with.",
  )


def check_adapter_source(path: str, adapters) -> None:
  """Raises ValueError unless the checkpoint at `path` holds exactly the adapters of `adapters` (the model's
  `nnx.LoRAParam` state): same modules, same shapes. Orbax's partial restore would otherwise load a subset of
  stored adapters without a word, or leave a targeted module at its fresh initialisation."""
  root = epath.Path(checkpointing._normalize_checkpoint_root(path))  # pylint: disable=protected-access
  stored = ocp.metadata(root).metadata.get("params", {})
  stored_adapters = {k: v for k, v in _shapes(stored).items() if "_lora_" in k}
  if not stored_adapters:
    raise ValueError(
        f"lora.lora_restore_path={path} holds no LoRA adapters; a full checkpoint is read with load_parameters_path."
    )
  expected = {f"params/{k}": v for k, v in _shapes(adapters.to_pure_dict()).items()}
  _raise_on_mismatches(
      f"The adapters at lora.lora_restore_path={path} were trained on a different model than this config builds",
      _compare(stored_adapters, expected),
      "Set the lora.* keys (lora_module_path, lora_rank) and model keys the adapters were trained with.",
  )


def _raise_on_mismatches(what: str, problems: list[str], advice: str) -> None:
  if problems:
    listed = "\n  ".join(problems[:_MAX_LISTED])
    more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
    raise ValueError(f"{what}:\n  {listed}{more}\n{advice}")


def check_same_adapter_source(checkpoint_manager, config) -> None:
  """Raises ValueError when a LoRA run resumes with another `lora.lora_restore_path` than the one its checkpoints
  record (MaxText saves the `lora` keys with each): the policy resumes from its own adapters either way, but the
  frozen reference of DPO and RL is base + the starting adapters, and would silently change."""
  step = None if checkpoint_manager is None else checkpointing.latest_step(checkpoint_manager)
  if step is None:
    return
  directory = checkpoint_manager.directory / str(step)
  stored = (checkpointing.load_checkpoint_metadata(str(directory)).get("lora") or {}).get("lora_restore_path")
  if stored is not None and stored != config.lora.lora_restore_path:
    raise ValueError(
        f"The run at {directory} started from lora.lora_restore_path={stored!r}, this config gives "
        f"{config.lora.lora_restore_path!r}. Resume with the run's value: the reference of DPO and RL is built from "
        "those adapters."
    )

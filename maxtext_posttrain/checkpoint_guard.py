"""Refuses to resume from a checkpoint written for a different model, or one that cannot be read, before anything
is written.

Auto-resume restores whatever the run directory holds. If the model keys changed since (another width, depth or
vocabulary), orbax would fail deep inside a restore, or a params-only overlay could silently keep fresh weights.
Comparing the stored parameter shapes with the model's abstract state first gives one clear error and leaves the
directory untouched. Adapters restored from another run (`lora.lora_restore_path`) are checked the same way.

A latest checkpoint whose files are damaged (truncated, corrupted, partly deleted) fails inside orbax with pages of
tree dumps; the restore's failure is reported in one line naming the step and its directory, nothing changed. With
`resume_readable_checkpoint` the step is set aside (renamed, not deleted) and the newest earlier step is restored.
A save that fails (a full disk) is reported naming the step; the steps saved before it are complete and untouched.
"""

import contextlib
import os
import re

import jax
from etils import epath
from orbax.checkpoint import v1 as ocp

from jax.experimental import multihost_utils

from maxtext.common import checkpointing
from maxtext.utils import max_logging
from maxtext.common import train_state_nnx
from maxtext_posttrain import cli
from maxtext_posttrain import config as config_lib
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


def require(path: str, key: str | None = None) -> epath.Path:
  """The checkpoint directory MaxText's `load_parameters_path` loader reads for `path`; raises ConfigError naming
  `path` (and the `key` that set it) when there is none, before orbax calls a missing directory an unknown layout."""
  root = epath.Path(checkpointing._normalize_checkpoint_root(path))  # pylint: disable=protected-access
  if not root.exists():
    raise config_lib.ConfigError(f"No checkpoint at {path}" + (f" ({key})." if key else "."))
  return root


def stored_params(path: str, key: str | None = None) -> dict:
  """The params tree (shaped metadata, no arrays) of the checkpoint MaxText's `load_parameters_path` would read (`key`:
  the key that set `path`, for the error when there is none)."""
  stored = ocp.metadata(require(path, key)).metadata.get("params", {})
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


class CheckpointRefused(ValueError):
  """A readable checkpoint that this config must not resume from or load (another model, other adapters)."""


class UnreadableCheckpoint(cli.Failure):
  """The latest checkpoint of a run cannot be restored."""


class CheckpointWriteFailed(cli.Failure):
  """A checkpoint save failed (a full disk, a lost mount); the earlier steps are intact."""


_ERROR_CHARS = 240
# How tensorstore (orbax's array writer) reports the operating system's error: `[os_error_code='28']`.
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


def _brief(error: BaseException) -> str:
  """The first error of `error`'s chain of causes (orbax wraps a read's failure in a dump of the whole tree), in one
  line of at most _ERROR_CHARS: its start and its end, after the operating system's reason when the error carries an
  error number whose reason the cut would drop (tensorstore's message puts the reason mid-way, its code at the end)."""
  while error.__cause__ is not None:
    error = error.__cause__
  text = " ".join(f"{type(error).__name__}: {error}".split())
  half = (_ERROR_CHARS - 5) // 2
  brief = text if len(text) <= _ERROR_CHARS else f"{text[:half]} ... {text[-half:]}"  # the cause is often at the end
  code = getattr(error, "errno", None) or next((int(m.group(1)) for m in _OS_ERROR_CODE.finditer(text)), None)
  if code and os.strerror(code) not in brief:
    brief = f"{os.strerror(code)} (OS error {code}): {brief}"
  return brief


def set_aside_unreadable(checkpoint_manager, config, error: Exception) -> None:
  """Handles `error`, raised while a role was restored or initialised: re-raised when there is no checkpoint to
  blame; else UnreadableCheckpoint naming the latest step and its directory, unless `resume_readable_checkpoint`,
  which renames that step's directory to `<step>.unreadable` (process 0; orbax lists integer names only) so that the
  caller's next attempt restores the newest earlier step."""
  step = None if checkpoint_manager is None else checkpointing.latest_step(checkpoint_manager)
  if step is None:
    raise error
  directory = checkpoint_manager.directory / str(step)
  if not config.resume_readable_checkpoint:
    raise UnreadableCheckpoint(
        f"The latest checkpoint, step {step} at {directory}, cannot be read: {_brief(error)}. Nothing was changed. "
        "resume_readable_checkpoint=true sets it aside and resumes from the newest earlier step that reads."
    ) from error
  aside = checkpoint_manager.directory / f"{step}.unreadable"
  if jax.process_index() == 0:
    suffix = 1
    while aside.exists():
      aside, suffix = checkpoint_manager.directory / f"{step}.unreadable.{suffix}", suffix + 1
    os.rename(directory, aside)
  multihost_utils.sync_global_devices(f"set aside unreadable checkpoint {step}")
  checkpoint_manager.close()
  max_logging.log(f"Checkpoint step {step} cannot be read ({_brief(error)}); set aside as {aside}, trying the previous.")


def drop_steps_after(checkpoint_manager, step: int) -> None:
  """Deletes the checkpoints after `step` (-1: all): a role's saves that ran ahead of the primary role's latest
  complete one, when a run was killed between the roles' saves at one step. Resumed, the run computes them again,
  bit for bit, from the step the primary role restores."""
  if checkpoint_manager is None:
    return
  for later in [s for s in checkpointing.all_steps(checkpoint_manager) if s > step]:
    max_logging.log(f"Removing {checkpoint_manager.directory / str(later)}: the primary role's latest step is {step}.")
    checkpoint_manager.delete(later)


@contextlib.contextmanager
def reporting_save_failures(checkpoint_manager, step: int | None):
  """Turns a failed save under the block (`step`'s, or an earlier asynchronous one that orbax reports now) into
  CheckpointWriteFailed naming the directory, the steps that are complete and the cause, in one line."""
  try:
    yield
  except Exception as error:  # pylint: disable=broad-exception-caught
    saved = [s for s in checkpointing.all_steps(checkpoint_manager) if (checkpoint_manager.directory / str(s)).exists()]
    which = "a checkpoint save" if step is None else f"the save at step {step} (or an earlier asynchronous one)"
    raise CheckpointWriteFailed(
        f"Writing {which} to {checkpoint_manager.directory} failed: {_brief(error)}. The complete steps there, "
        f"{saved or 'none'}, are untouched; a resumed run restores the newest."
    ) from error


def _raise_on_mismatches(what: str, problems: list[str], advice: str) -> None:
  if problems:
    listed = "\n  ".join(problems[:_MAX_LISTED])
    more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
    raise CheckpointRefused(f"{what}:\n  {listed}{more}\n{advice}")


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
    raise CheckpointRefused(
        f"The run at {directory} started from lora.lora_restore_path={stored!r}, this config gives "
        f"{config.lora.lora_restore_path!r}. Resume with the run's value: the reference of DPO and RL is built from "
        "those adapters."
    )

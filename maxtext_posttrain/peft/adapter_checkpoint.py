"""What an adapter-only (LoRA) checkpoint holds, for MaxText's save and restore and for this package's guards.

With `lora.enable_lora` MaxText saves and restores only the trainable part of the state, selected by
`checkpointing._filter_lora_trainable_state`. MaxText 0.2.5's selection treats the on-disk optax chain (a list) as
one leaf and drops it whole, so a resumed run restarted Adam's moments, bias correction and learning-rate schedule
at 0 and diverged from the uninterrupted run; and it keeps no scalar head, which a LoRA critic trains beside its
adapters. `adapter_state` is the selection this package uses; `install` makes MaxText's save and restore use it.
It is called where it is relied on (`trained_model.build`, before a LoRA role's checkpoint manager restores or
saves anything), and `checkpoint_guard` calls `adapter_state` itself rather than reading MaxText's attribute.
"""

from flax import nnx

from maxtext.common import checkpointing

SCALAR_HEAD = "scalar_head"  # forward.SCALAR_HEAD; a LoRA critic trains it with its adapters


def adapter_state(state):
  """The adapter-only part of a train state, checkpoint dict or NNX state: adapters, their optimizer moments, a
  scalar head and its moments, `step`, and optax's `count` leaves (bias correction and schedules)."""

  def keep(path, value=None) -> bool:
    names = [str(getattr(p, "key", p)).lower() for p in path]
    kept_names = ("lora", "step", SCALAR_HEAD)
    return isinstance(value, nnx.LoRAParam) or any(k in n for n in names for k in kept_names) or names[-1] == "count"

  if isinstance(state, (nnx.State, nnx.Module)):
    return nnx.state(state, keep)

  def select(node, path=()):
    if isinstance(node, list):  # an optax chain in MaxText's on-disk layout
      return [select(v, (*path, i)) or {} for i, v in enumerate(node)]
    if not isinstance(node, dict):
      return node if keep(path) else None
    kept = {k: v for k, v in ((k, select(v, (*path, k))) for k, v in node.items()) if v is not None}
    return kept or None

  return select(state)


def install() -> None:
  """Makes MaxText's adapter-only save, restore and weight checks select `adapter_state`."""
  checkpointing._filter_lora_trainable_state = adapter_state  # pylint: disable=protected-access


def installed() -> bool:
  return checkpointing._filter_lora_trainable_state is adapter_state  # pylint: disable=protected-access

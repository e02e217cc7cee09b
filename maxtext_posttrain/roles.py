"""Frozen models an objective reads besides the policy: the `reference` of DPO and of RL's KL term.

A role is the starting policy, frozen: built with MaxText's own model creation under the policy's mesh and logical
axis rules, from `load_parameters_path` when it is set and otherwise from the same seeded initialisation as the
policy, so at step 0 reference and policy agree exactly, and a resumed run gets the same reference as the run it
continues. Under LoRA no copy is made at all: the base weights are frozen, so the policy with its starting adapters
(zeros, or those of `lora.lora_restore_path`) *is* the starting policy.

Objectives run pure functions of a role (per-sequence log-probs of a batch, say) from their host hooks, each compiled
once under jit. The train step therefore never carries a second model's weights, the reference pass can be timed on
its own, and an objective that precomputes reference log-probs can drop the model afterwards.
"""

import dataclasses
from typing import Any, Callable

import jax
from flax import nnx
from flax.linen import partitioning as nn_partitioning

from maxtext.utils import max_logging
from maxtext_posttrain.peft import lora

ROLES = ("reference",)


@dataclasses.dataclass
class FrozenModel:
  """A MaxText model's graph and weights, with the config and mesh it runs under.

  `follows_policy` marks the LoRA reference: its weights are the policy's with the starting adapters, taken afresh
  by `follow` before each use, because the train step donates (and so invalidates) the previous step's arrays.
  """

  config: Any
  mesh: jax.sharding.Mesh
  graphdef: nnx.GraphDef | None
  state: nnx.State | None
  follows_policy: bool = False
  _start_adapters: nnx.State | None = dataclasses.field(default=None, repr=False)
  _compiled: dict[Callable, Callable] = dataclasses.field(default_factory=dict, repr=False)

  def run(self, fn: Callable, *args):
    """`fn(model, *args)` under jit, MaxText's mesh and logical axis rules; compiled once per `fn`."""
    if fn not in self._compiled:
      self._compiled[fn] = jax.jit(lambda state, *args: fn(nnx.merge(self.graphdef, state), *args))
    with jax.set_mesh(self.mesh), nn_partitioning.axis_rules(self.config.logical_axis_rules):
      return self._compiled[fn](self.state, *args)

  def follow(self, policy: nnx.Module) -> "FrozenModel":
    """Takes the LoRA `policy`'s current frozen base with the adapters it started from: the starting policy. The
    starting adapters are read once and kept apart from the train state (whose arrays the step donates)."""
    self.graphdef, state = nnx.split(policy)
    if self._start_adapters is None:
      self._start_adapters = lora.starting_adapters(state.filter(nnx.LoRAParam), self.config)
    self.state = nnx.merge_state(state, self._start_adapters)
    return self


def build(role: str, config, mesh, copy: bool = False) -> FrozenModel:
  """The frozen model for `role`. Under LoRA it follows the policy (see `FrozenModel.follow`) unless
  `copy` (for a one-off pass before the policy exists), which full-precision LoRA allows and QLoRA does not (its
  policy's base is quantized, so a full-precision copy would not be the starting policy)."""
  if role not in ROLES:
    raise ValueError(f"Unknown role {role!r}; the loop builds {list(ROLES)}.")
  if lora.enabled(config) and copy and config.lora.lora_weight_qtype:
    raise ValueError(
        f"A separate {role} model for QLoRA (lora.lora_weight_qtype={config.lora.lora_weight_qtype}) is not supported: "
        "it would not carry the policy's quantized base."
    )
  if lora.enabled(config) and not copy:
    max_logging.log(f"Role {role}: the policy with its starting LoRA adapters (no second copy of the weights).")
    return FrozenModel(config, mesh, None, None, follows_policy=True)
  source = config.load_parameters_path or f"the seeded initialisation (init_weights_seed={config.init_weights_seed})"
  if config.lora.lora_restore_path:  # validate_config: only with adapters on the policy
    source += f" with the adapters of {config.lora.lora_restore_path}"
  max_logging.log(f"Role {role}: a frozen copy of the starting policy from {source}.")
  graphdef, state = nnx.split(lora.pretrained_model(config, mesh))
  return FrozenModel(config, mesh, graphdef, state)

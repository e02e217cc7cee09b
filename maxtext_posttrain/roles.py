"""Roles: the MaxText models a run trains or reads, declared by its objective as specs.

An objective declares its roles (`RoleSpec`): the `policy` it trains, and others such as the frozen `reference` of
DPO and RL, the trained `critic` of PPO or the frozen `reward_model` that scores rollouts. Each role is a real
MaxText model, built by MaxText's model creation under the run's mesh and logical axis rules, with

- its config: the run's, or the run's with MaxText-style overrides from a config key, the way MaxText's
  distillation yml has `teacher_overrides` (`critic_overrides: {learning_rate: 1.e-5, base_num_decoder_layers: 4}`);
  the overrides are applied as MaxText applies its own, by initialising the config again from the run's argv;
- its head: MaxText's LM head, or a scalar head on the decoder's final hidden state (`forward.attach_scalar_head`);
- where its weights start: the role config's `load_parameters_path` (an objective sets it, e.g. a critic from the
  reward model's checkpoint), else the seeded initialisation (`init_weights_seed`);
- LoRA: on a trained role named in `lora_roles` when `lora.enable_lora` is set.

Trained roles become `trained_model.TrainedModel`s (optimizer, schedule, checkpoints, jitted steps); frozen roles
are `FrozenModel`s. A frozen role is read from host hooks (`FrozenModel.run`) or, with `in_step`, inside the jitted
train and eval steps, its weights passed in as an argument that is not donated.
"""

import contextlib
import dataclasses
import os
from typing import Any, Callable, Iterator, Literal, Mapping

import jax
import numpy as np
from flax import nnx
from flax.linen import partitioning as nn_partitioning
from jax.experimental import multihost_utils

from maxtext.configs import types
from maxtext.utils import max_logging
from maxtext.utils import model_creation_utils
from maxtext.utils import sharding
from maxtext_posttrain import checkpoint_guard
from maxtext_posttrain import config as config_lib
from maxtext_posttrain import forward
from maxtext_posttrain import layer_transfer
from maxtext_posttrain import progress
from maxtext_posttrain.data import pipeline
from maxtext_posttrain.peft import lora

POLICY = "policy"
REFERENCE = "reference"
TEACHER = "teacher"


@contextlib.contextmanager
def program_scope(mesh: jax.sharding.Mesh, rules):
  """The mesh and logical axis rules a role's programs are traced and run under."""
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(rules):
    yield


@dataclasses.dataclass(frozen=True)
class RoleSpec:
  """One model of a run, as its objective declares it.

  Attributes:
    name: the role's name (`policy`, `reference`, `critic`, `reward_model`, `teacher`, ...).
    trained: trained (an optimizer, checkpoints) or frozen.
    head: "lm" (MaxText's LM head: logits) or "scalar" (`forward.attach_scalar_head`: one value per position).
    overrides_key: the config key the overrides come from (`critic_overrides`), named in errors; None: the run's.
    overrides: MaxText keys over the run's config: the `overrides_key` section plus the objective's own choices
      (e.g. `load_parameters_path` of a critic that starts from the reward model).
    command_line: whether the run's command-line keys reach the role (yml < command line < overrides); False
      (yml < overrides) is how MaxText builds its distillation teacher from `teacher_overrides`.
    in_step: frozen roles: passed into the jitted train and eval steps, where the loss reads them.
    on_rollout_mesh: frozen roles read by host hooks: built and run on the rollout mesh (the sampler's devices, the
      trainer's unless an RL run samples ahead on devices of its own), where they score rollouts as they are
      sampled (`rl.reference_devices=sampler`).
    loss: trained roles: `loss(model, batch, is_train, frozen) -> objectives.LossOutput`, `frozen` the in-step
      frozen roles' models by name (None where only the role's state is built, as by export).
    prepare: `prepare(model) -> model`, what the objective adds to the model when it is built, before its graph is
      split (distillation's `layer_capture.enable_capture`); None: MaxText's model as built.
  """

  name: str
  trained: bool
  head: Literal["lm", "scalar"] = "lm"
  overrides_key: str | None = None
  overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  command_line: bool = True
  in_step: bool = False
  on_rollout_mesh: bool = False
  loss: Callable | None = None
  prepare: Callable | None = None

  def __post_init__(self):
    if self.loss is not None and not self.trained:
      raise ValueError(f"Role {self.name!r}: a frozen role has no loss.")
    if self.trained and self.in_step:
      raise ValueError(f"Role {self.name!r}: in_step applies to frozen roles (a trained role is the step's own).")
    if self.on_rollout_mesh and (self.trained or self.in_step):
      raise ValueError(f"Role {self.name!r}: on_rollout_mesh applies to frozen roles that host hooks run.")


def policy(loss: Callable | None = None) -> RoleSpec:
  """The trained policy on the run's own config: the model `load_parameters_path`, export and decoding read."""
  return RoleSpec(POLICY, trained=True, loss=loss)


def reference(in_step: bool = False, on_rollout_mesh: bool = False) -> RoleSpec:
  """The frozen starting policy (DPO's reference, RL's KL anchor)."""
  return RoleSpec(REFERENCE, trained=False, in_step=in_step, on_rollout_mesh=on_rollout_mesh)


def teacher(config, needed_by: str) -> RoleSpec:
  """The frozen teacher of distillation and of RL's KL-to-teacher term, read inside the jitted step: the yml plus
  `teacher_overrides`, without the command line's keys (which are the student's), as MaxText's train_distill builds
  it. `needed_by` names what asks for it in the error for a missing checkpoint."""
  overrides = dict(config.teacher_overrides)
  if not overrides.get("load_parameters_path"):
    raise config_lib.ConfigError(
        f"{needed_by} needs the teacher's weights: set teacher_overrides.load_parameters_path to a checkpoint of the "
        "model that the yml plus teacher_overrides describe."
    )
  return RoleSpec(
      TEACHER, trained=False, overrides_key="teacher_overrides", overrides=overrides, command_line=False, in_step=True
  )


def role_config(config, spec: RoleSpec, primary: bool = True):
  """The MaxText config `spec` runs: the run's config, or the run's re-initialised with `spec.overrides` (MaxText's
  precedence: yml < command line < overrides, or yml < overrides without `spec.command_line`). A trained role other
  than the primary one checkpoints beside the primary's `<run>/checkpoints`, in `<run>/<role>/checkpoints`, without
  the data iterator's state, which the primary's checkpoints carry (MaxText saves it for dataset_type=grain; the
  role's config reads no data), and without `lora.lora_restore_path`, whose adapters are the policy's."""
  if not spec.overrides and spec.command_line:
    role = config
  else:
    config_lib.check_override_keys(spec.overrides_key or spec.name, spec.overrides)
    role = config_lib.reinitialize(config, spec.command_line, **spec.overrides)
    check_same_tokens(config, role, f"{spec.name} ({spec.overrides_key})" if spec.overrides_key else spec.name)
  if spec.trained and not primary:
    role = config_lib.with_overrides(
        role,
        checkpoint_dir=os.path.join(config.base_output_directory, config.run_name, spec.name, "checkpoints", ""),
        dataset_type=types.DatasetType.SYNTHETIC,
        # lora.lora_restore_path names the policy's starting adapters; another role's start fresh.
        lora=role.lora.model_copy(update={"lora_restore_path": ""}),
    )
  return role


def check_same_tokens(config, role, name: str) -> None:
  """Raises ValueError when a role reads other token ids than the run's policy: another tokenizer or vocabulary
  would score the policy's completions as different text."""
  differ = [
      f"{key}={getattr(role, key)!r} (policy: {getattr(config, key)!r})"
      for key in ("tokenizer_path", "tokenizer_type", "vocab_size")
      if getattr(role, key) != getattr(config, key)
  ]
  if differ:
    raise config_lib.ConfigError(f"Role {name} reads other tokens than the policy: {'; '.join(differ)}.")


def model_initializer(config, spec: RoleSpec, mesh) -> tuple[Callable[[], nnx.Module], nnx.Module]:
  """(a zero-argument function building `spec`'s model, no weights loaded; MaxText's abstract model of `config`):
  MaxText's model with the role's head and, for a trained role in `lora_roles`, its adapters."""
  create_model, abstract_model = model_creation_utils.create_nnx_abstract_model(config, mesh)

  def init_model():
    model = create_model()
    if spec.head == "scalar":
      forward.attach_scalar_head(model, config)
    else:
      forward.with_lm_head(model)
    if spec.prepare is not None:
      model = spec.prepare(model)
    return lora.apply(model, config, spec.name) if spec.trained else model

  return init_model, abstract_model


def starting_checkpoint_key(spec: RoleSpec) -> str:
  """The key an error about `spec`'s starting checkpoint names: the run's `load_parameters_path`, or the role's."""
  return f"{spec.overrides_key}.load_parameters_path" if spec.overrides_key else "load_parameters_path"


def load_start_weights(model_state: nnx.State, config, spec: RoleSpec) -> nnx.State:
  """`model_state` (a role's params, concrete) with the weights of the role's `load_parameters_path` read over it.

  A scalar-head role reads the checkpoint's head when it has one (and never an output projection: it has none); a
  trained role starting from a checkpoint without a head (a policy's) keeps its fresh head, while a frozen one
  refuses it (a reward model needs a trained head). The stored shapes are compared with the model's first, so a
  checkpoint of another model fails naming the path and the difference before anything loads. LoRA adapters and
  distillation's learned feature map are not read from it (they start fresh).
  """
  path = config.load_parameters_path
  wanted = model_state.filter(nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam), nnx.Not(layer_transfer.FeatureProjection)))
  stored = checkpoint_guard.stored_params(path, starting_checkpoint_key(spec))
  stored = {k: v for k, v in stored.items() if k != layer_transfer.PROJECTION}
  if spec.head == "scalar":
    stored = forward.without_output_projection(stored)
  if spec.head == "scalar" and not forward.has_scalar_head(stored):
    if not spec.trained:
      raise config_lib.ConfigError(
          f"Role {spec.name}: the checkpoint at {path} has no scalar head ({forward.SCALAR_HEAD}); it is not a "
          "reward model's. Train one with posttrain_mode=reward_model."
      )
    max_logging.log(f"Role {spec.name}: {path} has no scalar head; the head starts at zero.")
    wanted = nnx.State({k: v for k, v in wanted.items() if k != forward.SCALAR_HEAD})
  checkpoint_guard.check_params(path, stored, wanted, f"Role {spec.name}")
  loaded = lora.load_like(path, wanted, config)
  return nnx.merge_state(model_state, loaded)


@dataclasses.dataclass
class FrozenModel:
  """A MaxText model's graph and weights, with the config and mesh it runs under.

  `follows_policy` marks the LoRA reference: its weights are the policy's with the starting adapters, taken afresh
  by `follow` before each use, because the train step donates (and so invalidates) the previous step's arrays.
  """

  spec: RoleSpec
  config: Any
  mesh: jax.sharding.Mesh
  graphdef: nnx.GraphDef | None
  state: nnx.State | None
  follows_policy: bool = False
  _start_adapters: nnx.State | None = dataclasses.field(default=None, repr=False)
  _compiled: dict[Callable, Callable] = dataclasses.field(default_factory=dict, repr=False)

  def jitted(self, fn: Callable) -> Callable:
    """`fn(model, *args)` jitted over the weights, `(state, *args)`, once per `fn`: the program `run` runs and
    `maxtext_posttrain.compile` lowers for a topology (under `scope()`)."""
    if fn not in self._compiled:
      self._compiled[fn] = jax.jit(lambda state, *args: fn(nnx.merge(self.graphdef, state), *args))
    return self._compiled[fn]

  def scope(self):
    """The mesh and logical axis rules the role's programs run under."""
    return program_scope(self.mesh, self.config.logical_axis_rules)

  def run(self, fn: Callable, *args):
    """`fn(model, *args)` under jit, MaxText's mesh and logical axis rules; compiled once per `fn`."""
    with self.scope():
      return self.jitted(fn)(self.state, *args)

  def run_over_rows(
      self,
      fn: Callable,
      count: int,
      rows_at: Callable[[list[int]], dict[str, np.ndarray]],
      batch_size: int,
      *args,
      label: str,
  ) -> Iterator[tuple[int, Any]]:
    """`fn(model, batch, *args)` over rows 0, ..., `count` - 1, `batch_size` rows a call (the last call repeats the
    last row to fill it), placed on the role's input data sharding; yields (the call's first row, `fn`'s outputs for
    the call's rows as numpy arrays gathered on every process, without the repeats), with a progress line under
    `label` every tenth of the calls. `rows_at(indices)` builds rows, {key: [len(indices), ...] array}: each process
    builds only its block of each call's rows where the batch axis splits across processes in blocks
    (`pipeline.process_block`; MaxText's data layouts), every row otherwise (e.g. a tensor-parallel axis over hosts)."""
    block = pipeline.process_block(pipeline.batch_sharding(self.config, self.mesh, 1), (batch_size,))
    place = pipeline.global_batch if block is None else pipeline.process_local_batch
    calls, meter = -(-count // batch_size), None
    for call, start in enumerate(range(0, count, batch_size)):
      indices = [min(i, count - 1) for i in range(start, start + batch_size)]
      mine = indices if block is None else indices[block]
      rows = rows_at(mine)
      if meter is None:  # tokens: the rows' input ids (both sides of a pair), over all processes
        tokens = sum(v.size for k, v in rows.items() if k.endswith("inputs")) * batch_size // len(mine)
        meter = progress.Progress(calls, 0, tokens, label=label, unit="call")
      outputs = multihost_utils.process_allgather(self.run(fn, place(rows, self.config, self.mesh), *args), tiled=True)
      yield start, jax.tree.map(lambda x: np.asarray(x)[: min(batch_size, count - start)], outputs)
      if (call + 1) % max(1, calls // 10) == 0 or call + 1 == calls:
        meter.report(call + 1)

  def follow(self, policy_model: nnx.Module) -> "FrozenModel":
    """Takes the LoRA `policy_model`'s current frozen base with the adapters it started from: the starting policy.
    The starting adapters are read once and kept apart from the train state (whose arrays the step donates)."""
    self.graphdef, state = nnx.split(policy_model)
    if self._start_adapters is None:
      self._start_adapters = lora.starting_adapters(state.filter(nnx.LoRAParam), self.config)
    self.state = nnx.merge_state(state, self._start_adapters)
    return self


def build_frozen(spec: RoleSpec, config, mesh, copy: bool = False) -> FrozenModel:
  """The frozen model of `spec` under the run `config`.

  The reference (the run's own config, LM head) is the starting policy: under LoRA the policy itself with its
  starting adapters (see `FrozenModel.follow`) unless `copy` (a one-off pass before the policy exists, which
  full-precision LoRA allows and QLoRA does not: its policy's base is quantized); otherwise MaxText's
  `from_pretrained` model of `load_parameters_path` or the seeded init, with `lora.lora_restore_path`'s adapters.
  Any other role is built from its own config and head and reads its `load_parameters_path`.
  """
  if _is_starting_policy(spec, config):
    return _starting_policy(spec, config, mesh, copy)
  role = role_config(config, spec)
  init_model, graphdef, _, shardings = _abstract_model(role, spec, mesh)
  with program_scope(mesh, role.logical_axis_rules):
    state = jax.jit(lambda: nnx.state(init_model()), out_shardings=shardings)()
  if role.load_parameters_path:
    state = load_start_weights(state, role, spec)
  elif spec.head == "scalar":
    raise config_lib.ConfigError(
        f"Role {spec.name} reads a scalar head but no checkpoint: set {spec.overrides_key}.load_parameters_path."
    )
  source = role.load_parameters_path or f"the seeded initialisation (init_weights_seed={role.init_weights_seed})"
  max_logging.log(f"Role {spec.name}: a frozen {spec.head}-head model from {source}.")
  return FrozenModel(spec, role, mesh, graphdef, state)


def _abstract_model(role, spec: RoleSpec, mesh):
  """(init_model, graphdef, abstract state, its shardings) of `spec`'s model under its role config `role`. The
  shardings resolve the weights' logical axes by the role's rules, as MaxText's `get_abstract_state` does (outside
  the rules every weight would be replicated on every device)."""
  init_model, _ = model_initializer(role, spec, mesh)
  with nn_partitioning.axis_rules(role.logical_axis_rules):
    graphdef, abstract_state = nnx.split(nnx.eval_shape(init_model))
    return init_model, graphdef, abstract_state, sharding.nnx_construct_named_sharding(abstract_state, mesh)


def _is_starting_policy(spec: RoleSpec, config) -> bool:
  """Whether frozen `spec` is the starting policy (the run's config, LM head); refuses what cannot be frozen."""
  if spec.trained:
    raise ValueError(f"Role {spec.name} is trained, not frozen.")
  starting_policy = spec.head == "lm" and not spec.overrides
  if starting_policy and spec.in_step and lora.enabled(config):
    raise config_lib.ConfigError(
        f"Role {spec.name}: an in-step starting policy under LoRA is not supported: it is the policy's own base, "
        "whose arrays the step donates."
    )
  return starting_policy


def abstract_frozen(spec: RoleSpec, config, mesh, copy: bool = False) -> FrozenModel:
  """The frozen model `build_frozen` builds, its weights shaped, sharded `jax.ShapeDtypeStruct`s: nothing is
  initialised or read, so its programs lower for a device topology this host lacks (`maxtext_posttrain.compile`).
  The LoRA reference follows the policy here too (`follows_policy`, no weights of its own) unless `copy`; a
  reference with `lora.lora_restore_path` adapters is shaped without them."""
  if _is_starting_policy(spec, config) and lora.enabled(config) and not copy:
    return FrozenModel(spec, config, mesh, None, None, follows_policy=True)
  role = role_config(config, spec)
  _, graphdef, abstract_state, shardings = _abstract_model(role, spec, mesh)
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings)
  return FrozenModel(spec, role, mesh, graphdef, state)


def _starting_policy(spec: RoleSpec, config, mesh, copy: bool) -> FrozenModel:
  if lora.enabled(config) and copy and config.lora.lora_weight_qtype:
    raise config_lib.ConfigError(
        f"A separate {spec.name} model for QLoRA (lora.lora_weight_qtype={config.lora.lora_weight_qtype}) is not "
        "supported: it would not carry the policy's quantized base."
    )
  if lora.enabled(config) and not copy:
    max_logging.log(f"Role {spec.name}: the policy with its starting LoRA adapters (no second copy of the weights).")
    return FrozenModel(spec, config, mesh, None, None, follows_policy=True)
  source = config.load_parameters_path or f"the seeded initialisation (init_weights_seed={config.init_weights_seed})"
  if config.lora.lora_restore_path:  # validate_config: only with adapters on the policy
    source += f" with the adapters of {config.lora.lora_restore_path}"
  max_logging.log(f"Role {spec.name}: a frozen copy of the starting policy from {source}.")
  graphdef, state = nnx.split(lora.pretrained_model(config, mesh))
  return FrozenModel(spec, config, mesh, graphdef, state)

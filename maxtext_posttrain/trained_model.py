"""A trained role: a MaxText model with MaxText's optimizer, schedule, checkpoints and jitted train and eval steps.

Everything model-shaped is MaxText's: model creation and sharding rules, `create_training_optimizer` (the role's own
learning rate, schedule, clipping and accumulation keys), orbax checkpointing through `create_checkpoint_manager`
(auto-resume, `load_parameters_path`), `setup_training_state`, and the signature of MaxText's train step, whose
shardings and donation `get_functional_train_with_signature` supplies. The step differentiates the role's loss
(`RoleSpec.loss`); frozen roles read inside the step come in as a third argument, not donated.

Building one reads top to bottom: abstract state, checkpoint manager and its guard, LoRA's start checks, restore or
initialise, the role's starting weights, the jitted steps. `abstract` gives the same steps over a state of shapes
alone, which `maxtext_posttrain.compile` lowers for a TPU topology.
"""

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import partitioning as nn_partitioning
import optax

from maxtext.common import checkpointing
from maxtext.common import train_state_nnx
from maxtext.utils import gradient_accumulation
from maxtext.utils import max_utils
from maxtext.utils import maxtext_utils
from maxtext.utils import sharding
from maxtext.utils import train_utils

from maxtext_posttrain import checkpoint_guard
from maxtext_posttrain import config as config_lib
from maxtext_posttrain import forward
from maxtext_posttrain import layer_transfer
from maxtext_posttrain import load_balance
from maxtext_posttrain import roles as roles_lib
from maxtext_posttrain.peft import adapter_checkpoint
from maxtext_posttrain.peft import lora


def _accumulated_adapter_grads(loss_fn, config, model, batch, frozen, trainable):
  """(loss, weight, metric sums, grads) accumulated over microbatches, differentiating `trainable` only.

  MaxText's accumulation differentiates every `nnx.Param`, which under LoRA is the frozen base too (under QLoRA its
  integer codes, which have no gradient). This differentiates the adapters only, over the microbatches MaxText
  forms (row r of the batch goes to microbatch r % steps), summing (total, weight, metrics, grads) and dividing by
  the weight of the whole batch, as MaxText does. The model's RNG state is not advanced between microbatches.
  """
  steps = config.gradient_accumulation_steps
  graphdef, params, rest = nnx.split(model, trainable, ...)
  data = jax.tree.map(lambda x: jnp.swapaxes(x.reshape((x.shape[0] // steps, steps) + x.shape[1:]), 0, 1), batch)

  def summed(params, microbatch):
    out = loss_fn(nnx.merge(graphdef, params, rest, copy=True), microbatch, True, frozen())
    return out.total, out

  def accumulate(sums, microbatch):
    (_, out), grads = jax.value_and_grad(summed, has_aux=True)(params, microbatch)
    return jax.tree.map(jnp.add, sums, (grads, out)), None

  out_shapes = jax.eval_shape(lambda m: summed(params, m)[1], jax.tree.map(lambda x: x[0], data))
  zeros = (jax.tree.map(jnp.zeros_like, params), jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shapes))
  (grads, out), _ = jax.lax.scan(accumulate, zeros, data)
  weight = jnp.maximum(out.weight, 1.0)
  return out.total / weight, out.weight, out.metrics, jax.tree.map(lambda g: g / weight, grads)


def _loss_and_grads(loss_fn, config, model, params_shardings, batch, frozen, trainable):
  """(loss, weight, metric sums, raw grads) of a role's loss, with MaxText's gradient accumulation when enabled.
  `frozen()` builds the in-step frozen roles' models inside each traced loss (a module built outside a transform
  cannot be called inside it)."""
  if config.gradient_accumulation_steps > 1 and trainable is not nnx.Param:
    return _accumulated_adapter_grads(loss_fn, config, model, batch, frozen, trainable)
  if config.gradient_accumulation_steps > 1:

    # MaxText's accumulation differentiates a summed loss, reading the sum and its weight from `xent_sum` and
    # `total_weights`; it then divides the accumulated gradient by the weight of the whole batch.
    def summed_loss(model, config, data, dropout_rng, params, is_train=True):
      del config, dropout_rng, params
      out = loss_fn(model, data, is_train, frozen())
      aux = {"xent_sum": out.total, "total_weights": out.weight, "metrics": out.metrics}
      aux |= {"moe_lb_loss": 0.0, "indexer_loss": 0.0, "mtp_loss": 0.0}
      return out.total, aux

    loss, aux, grads = gradient_accumulation.gradient_accumulation_loss_and_grad(
        summed_loss, config, model, None, params_shardings, batch, None
    )
    return loss, aux["total_weights"], aux["metrics"], grads

  # Under LoRA only the adapters are differentiated; the frozen (maybe quantized) base rides along in `rest`.
  model_graphdef, params, rest = nnx.split(model, trainable, ...)

  def mean_loss(params):
    local_model = nnx.merge(model_graphdef, params, rest, copy=True)
    out = loss_fn(local_model, batch, True, frozen())
    return out.total / jnp.maximum(out.weight, 1.0), (out, nnx.state(local_model, nnx.Not(nnx.Param)))

  (loss, (out, new_rest)), grads = jax.value_and_grad(mean_loss, has_aux=True)(params)
  nnx.update(model, new_rest)
  return loss, out.weight, out.metrics, grads


def _frozen_models(frozen_graphdefs: dict[str, nnx.GraphDef], frozen_states: dict[str, nnx.State]):
  """A function building the in-step frozen roles' models, by name, from their (traced) states. Each call makes
  fresh variables at the caller's trace level (`copy=True`): MaxText's unscanned decoder writes its layers' state
  back as it runs, which flax refuses on variables of the enclosing jit's level (TraceContextError)."""
  return lambda: {
      name: nnx.merge(graphdef, frozen_states[name], copy=True) for name, graphdef in frozen_graphdefs.items()
  }


# 1.0 for a step whose loss or gradient norm was NaN or infinite (under nonfinite_policy=skip it left the state as it was).
NONFINITE_METRIC = "learning/nonfinite"


def make_train_step(spec: roles_lib.RoleSpec, trainable, frozen_graphdefs: dict[str, nnx.GraphDef]):
  """A train step with MaxText's signature plus the in-step frozen roles' states, so MaxText's
  `get_functional_train_with_signature` supplies the state's shardings and donation."""

  def train_step(graphdef, config, state_mesh_shardings, params_shardings, state, data, frozen_states):
    del state_mesh_shardings
    train_state = nnx.merge(graphdef, state)
    nnx.pop(train_state.model, nnx.Intermediate)
    frozen = _frozen_models(frozen_graphdefs, frozen_states)
    loss_fn = load_balance.with_load_balance_loss(spec.loss, config)
    loss, weight, metric_sums, raw_grads = _loss_and_grads(
        loss_fn, config, train_state.model, params_shardings, data, frozen, trainable
    )
    raw_grads = jax.tree.map(lambda g: g.astype(config.grad_dtype) if g.dtype == jnp.float32 else g, raw_grads)
    # optax's global norm, the one its clip_by_global_norm computes: XLA can share the reduction. After clipping,
    # the norm is the raw one or the threshold clipping scales it to (optax clips where the norm reaches it), so the
    # logged grad_norm needs no pass over the clipped gradients.
    raw_grad_norm = optax.tree.norm(raw_grads)
    if config.gradient_clipping_threshold > 0:
      grads = maxtext_utils.apply_gradient_clipping(raw_grads, None, config.gradient_clipping_threshold)
      grad_norm = jnp.minimum(raw_grad_norm, config.gradient_clipping_threshold)
    else:
      grads, grad_norm = raw_grads, raw_grad_norm
    finite = jnp.isfinite(loss) & jnp.isfinite(raw_grad_norm)
    if config.nonfinite_policy == "skip":  # the state before the update, kept for a non-finite step
      before = jax.tree.map(lambda x: x, nnx.state(train_state, nnx.Not(nnx.Intermediate)))  # new Variables: kept
    if config.skip_step_on_spikes:  # MaxText's spike-skipping optimizer reads the loss and gradient norm
      train_state.apply_gradients(grads, loss=loss, grad_norm=grad_norm)
    else:
      train_state.apply_gradients(grads)
    if config.nonfinite_policy == "skip":
      # A non-finite loss or gradient does not reach the weights or the optimizer state: the step keeps the state it
      # was given. The select holds the state before and after the update at once (one more copy of it in the
      # step's temporaries), so only a skipping run pays for it; under `stop` the run ends before any save.
      updated = nnx.state(train_state, nnx.Not(nnx.Intermediate))
      nnx.update(train_state, jax.tree.map(lambda new, old: jnp.where(finite, new, old), updated, before))
    scalars = {
        "learning/loss": loss,
        "learning/total_weights": weight,
        "learning/grad_norm": grad_norm,
        "learning/raw_grad_norm": raw_grad_norm,
        "learning/param_norm": max_utils.l2norm_pytree(nnx.state(train_state.model, trainable)),
        NONFINITE_METRIC: 1.0 - finite.astype(jnp.float32),
    }
    scalars |= {f"learning/{k}": v / jnp.maximum(weight, 1.0) for k, v in metric_sums.items()}
    return nnx.state(train_state, nnx.Not(nnx.Intermediate)), {"scalar": scalars, "scalars": {}}

  return train_step


def make_eval_step(spec: roles_lib.RoleSpec, frozen_graphdefs: dict[str, nnx.GraphDef]):
  """An eval step with MaxText's signature plus the in-step frozen roles' states: the (total, weight) of the role's
  loss on one batch."""

  def eval_step(graphdef, config, state, data, frozen_states):
    loss_fn = load_balance.with_load_balance_loss(spec.loss, config)
    out = loss_fn(nnx.merge(graphdef, state).model, data, False, _frozen_models(frozen_graphdefs, frozen_states)())
    scalars = {"evaluation/total_loss": out.total, "evaluation/total_weights": out.weight}
    return {"scalar": scalars | {f"evaluation/metrics/{k}": v for k, v in out.metrics.items()}}

  return eval_step


def trainable_filter(config, spec: roles_lib.RoleSpec):
  """What gets gradients and optimizer state: every weight, or under LoRA the adapters (and a scalar head)."""
  if not lora.enabled(config, spec.name):
    return nnx.Param
  if spec.head == "scalar":
    return nnx.Any(nnx.LoRAParam, nnx.PathContains(forward.SCALAR_HEAD))
  return nnx.LoRAParam


def state_initializer(config, mesh, spec: roles_lib.RoleSpec) -> tuple[Callable[[], train_state_nnx.TrainStateNNX], Any]:
  """(init_state_fn, learning-rate schedule): the role's model (with its head and adapters) and MaxText's optimizer
  over what it trains, as MaxText's `setup_training_state` and `nnx.eval_shape` take it."""
  init_model, abstract_model = roles_lib.model_initializer(config, spec, mesh)
  learning_rate_schedule, tx = train_utils.create_training_optimizer(config, abstract_model, mesh=mesh)
  trainable = trainable_filter(config, spec)

  def init_state_fn():
    model = init_model()
    return train_state_nnx.TrainStateNNX(model, nnx.Optimizer(model, tx, wrt=trainable))

  return init_state_fn, learning_rate_schedule


@dataclasses.dataclass
class TrainedModel:
  """One trained role's state and programs. `state` is the pure state of a TrainStateNNX: {"model", "optimizer"}."""

  spec: roles_lib.RoleSpec
  config: Any
  mesh: jax.sharding.Mesh
  graphdef: nnx.GraphDef
  state: nnx.State
  state_mesh_shardings: nnx.State
  checkpoint_manager: Any
  learning_rate_schedule: Any
  trainable: Any
  p_train_step: Callable
  p_eval_step: Callable | None
  start_step: int
  _compiled: dict[Callable, Callable] = dataclasses.field(default_factory=dict, repr=False)

  @property
  def name(self) -> str:
    return self.spec.name

  def model(self) -> nnx.Module:
    """The model with the current weights (shares the arrays of `state`, no copy)."""
    return nnx.merge(self.graphdef, self.state).model

  def scope(self, evaluation: bool = False):
    """The mesh and logical axis rules the role's programs run under (MaxText's eval rules for the eval step)."""
    config = self.config
    return roles_lib.program_scope(
        self.mesh, config.logical_axis_rules_for_eval if evaluation else config.logical_axis_rules
    )

  def jitted(self, fn: Callable) -> Callable:
    """`fn(model, *args)` jitted over the role's state, `(state, *args)`, once per `fn`: the program `run` runs
    and `maxtext_posttrain.compile` lowers for a topology (under `scope()`)."""
    if fn not in self._compiled:
      self._compiled[fn] = jax.jit(lambda state, *args: fn(nnx.merge(self.graphdef, state).model, *args))
    return self._compiled[fn]

  def run(self, fn: Callable, *args):
    """`fn(model, *args)` on the current weights under jit, the mesh and logical axis rules; compiled once per `fn`.
    For host hooks that read a trained role without training it (a critic's values of fresh rollouts)."""
    with self.scope():
      return self.jitted(fn)(self.state, *args)

  def train_step(self, batch, frozen_states: dict[str, nnx.State]):
    """One optimizer step on `batch`; returns MaxText's metrics dict. The previous state's arrays are donated."""
    with self.scope():
      self.state, metrics = self.p_train_step(self.state, batch, frozen_states)
    return metrics

  def eval_step(self, batch, frozen_states: dict[str, nnx.State]):
    with self.scope(evaluation=True):
      return self.p_eval_step(self.state, batch, frozen_states)

  def save(self, step: int, data_iterator, final: bool = False) -> None:
    """MaxText's periodic save at `step`; `final` also saves a step off the period (MaxText's final save). A failed
    save (here, or an asynchronous one found failed now) raises CheckpointWriteFailed naming its step."""
    with checkpoint_guard.reporting_save_failures(self.checkpoint_manager, step):
      if final and step % self.config.checkpoint_period:
        if self.checkpoint_manager is not None and step not in checkpointing.all_steps(self.checkpoint_manager):
          checkpointing.save_checkpoint(self.checkpoint_manager, step, self.state, self.config, data_iterator, force=True)
          checkpointing.print_save_message(step, self.config.async_checkpointing)
        return
      checkpointing.maybe_save_checkpoint(self.checkpoint_manager, self.state, self.config, data_iterator, step)

  def latest_step(self) -> int | None:
    return None if self.checkpoint_manager is None else checkpointing.latest_step(self.checkpoint_manager)

  def saved_steps(self) -> set[int]:
    """The steps whose checkpoints the manager keeps (MaxText's `max_num_checkpoints_to_keep` removes older ones)."""
    return set() if self.checkpoint_manager is None else set(checkpointing.all_steps(self.checkpoint_manager))

  def wait_until_finished(self) -> None:
    if self.checkpoint_manager is not None:
      with checkpoint_guard.reporting_save_failures(self.checkpoint_manager, None):
        checkpointing.wait_until_finished(self.checkpoint_manager)


def _jit_steps(spec, config, graphdef, state_mesh_shardings, params_shardings, frozen, data_sharding, eval_data_sharding):
  """(train step, eval step or None) of a trained role, jitted with MaxText's shardings and donation; the in-step
  frozen roles' states are a last argument, sharded as they are and not donated."""
  in_step = {name: role for name, role in frozen.items() if role.spec.in_step}
  frozen_graphdefs = {name: role.graphdef for name, role in in_step.items()}
  frozen_shardings = {name: jax.tree.map(lambda x: x.sharding, role.state) for name, role in in_step.items()}
  functional_train, in_shardings, out_shardings, static_argnums, donate_argnums = (
      maxtext_utils.get_functional_train_with_signature(
          make_train_step(spec, trainable_filter(config, spec), frozen_graphdefs),
          data_sharding,
          state_mesh_shardings,
          graphdef,
          config,
          params_shardings,
      )
  )
  p_train_step = jax.jit(
      functional_train,
      in_shardings=(*in_shardings, frozen_shardings),
      out_shardings=out_shardings,
      static_argnums=static_argnums,
      donate_argnums=donate_argnums,
  )
  if eval_data_sharding is None:
    return p_train_step, None
  functional_eval, in_shardings, out_shardings, static_argnums, donate_argnums = (
      maxtext_utils.get_functional_eval_with_signature(
          make_eval_step(spec, frozen_graphdefs), eval_data_sharding, state_mesh_shardings, graphdef, config
      )
  )
  p_eval_step = jax.jit(
      functional_eval,
      in_shardings=(*in_shardings, frozen_shardings),
      out_shardings=out_shardings,
      static_argnums=static_argnums,
      donate_argnums=donate_argnums,
  )
  return p_train_step, p_eval_step


def build(
    spec: roles_lib.RoleSpec,
    config,
    mesh,
    data_iterator,
    frozen: dict[str, roles_lib.FrozenModel],
    data_sharding,
    eval_data_sharding=None,
    resume_at: int | None = None,
):
  """The trained role `spec` under its role `config`, restored from its checkpoints or initialised, and its jitted
  steps. Returns (TrainedModel, the data iterator as MaxText's restore left it). `resume_at`: for a role other than
  the primary one, the primary's latest step (-1: none); this role's checkpoints after it are dropped (a run killed
  between the roles' saves at one step)."""
  if spec.loss is None:
    raise ValueError(f"Role {spec.name} is trained but declares no loss.")
  init_state_fn, learning_rate_schedule = state_initializer(config, mesh, spec)
  with nn_partitioning.axis_rules(config.logical_axis_rules):
    abstract_state = nnx.eval_shape(init_state_fn)
  while True:
    checkpoint_manager = train_utils.create_checkpoint_manager(config, mesh, init_state_fn)
    if resume_at is not None:
      checkpoint_guard.drop_steps_after(checkpoint_manager, resume_at)
    try:
      state, state_mesh_shardings, data_iterator, start_step = _restore_or_initialise(
          spec, config, mesh, checkpoint_manager, data_iterator, abstract_state, init_state_fn
      )
      break
    except (checkpoint_guard.CheckpointRefused, config_lib.ConfigError):
      raise
    except Exception as error:  # pylint: disable=broad-exception-caught
      # Raises naming the step unless resume_readable_checkpoint sets that step aside; then the next newest is tried.
      checkpoint_guard.set_aside_unreadable(checkpoint_manager, config, error)
  if start_step > config.steps:  # MaxText's check; a run that completed exactly `steps` is relaunched as a no-op
    train_utils.validate_completed_steps(start_step, config.steps)
  graphdef = nnx.graphdef(abstract_state)
  params_shardings, state_mesh_shardings = sharding.maybe_update_params_sharding_with_opt(config, state_mesh_shardings)
  p_train_step, p_eval_step = _jit_steps(
      spec, config, graphdef, state_mesh_shardings, params_shardings, frozen, data_sharding, eval_data_sharding
  )
  model = TrainedModel(
      spec=spec,
      config=config,
      mesh=mesh,
      graphdef=graphdef,
      state=state,
      state_mesh_shardings=state_mesh_shardings,
      checkpoint_manager=checkpoint_manager,
      learning_rate_schedule=learning_rate_schedule,
      trainable=trainable_filter(config, spec),
      p_train_step=p_train_step,
      p_eval_step=p_eval_step,
      start_step=start_step,
  )
  return model, data_iterator


def _restore_or_initialise(spec, config, mesh, checkpoint_manager, data_iterator, abstract_state, init_state_fn):
  """(state, its shardings, the data iterator, the step to run next): the latest checkpoint restored by MaxText's
  loader, or the role's starting weights."""
  adapters = lora.enabled(config, spec.name)
  if adapters:  # MaxText's save and restore then keep the adapter state this package defines
    adapter_checkpoint.install()
  checkpoint_guard.check_compatible(checkpoint_manager, abstract_state, adapters_only=adapters)
  resuming = checkpoint_manager is not None and checkpointing.latest_step(checkpoint_manager) is not None
  # The role's starting weights are read by MaxText's loader, except where the state cannot take a checkpoint's
  # tree as is: a scalar head the checkpoint may lack, distillation's learned feature map, or the quantized base of
  # QLoRA.
  extra_params = spec.head == "scalar" or layer_transfer.has_projection(abstract_state.model)
  own_start = not resuming and bool(config.load_parameters_path) and extra_params
  setup_config = config
  if adapters:
    setup_config = lora.prepare_start(config, checkpoint_manager, abstract_state, resuming)
  if not resuming and config.load_parameters_path:  # a resumed run ignores it, as MaxText does
    checkpoint_guard.require(config.load_parameters_path, roles_lib.starting_checkpoint_key(spec))
  if own_start:
    setup_config = config_lib.with_overrides(setup_config, load_parameters_path="")
  state, _, state_mesh_shardings, data_iterator, _ = maxtext_utils.setup_training_state(
      data_iterator, setup_config, mesh, checkpoint_manager, init_state_fn
  )
  if adapters:
    state = lora.finish_start(state, config, mesh, resuming)
  if own_start:
    state["model"] = roles_lib.load_start_weights(state.model, config, spec)
  start_step = checkpointing.latest_step(checkpoint_manager) + 1 if resuming else 0
  return state, state_mesh_shardings, data_iterator, start_step


def abstract(
    spec: roles_lib.RoleSpec,
    config,
    mesh,
    frozen: dict[str, roles_lib.FrozenModel],
    data_sharding,
    eval_data_sharding=None,
) -> TrainedModel:
  """The trained role `spec` with the jitted steps `build` gives it, its state shaped, sharded
  `jax.ShapeDtypeStruct`s (MaxText's `get_abstract_state`, as MaxText's train_compile takes it): nothing is
  initialised, read or written, so the steps lower for a device topology this host lacks (`maxtext_posttrain.compile`).
  `frozen` may be abstract too."""
  if spec.loss is None:
    raise ValueError(f"Role {spec.name} is trained but declares no loss.")
  init_state_fn, learning_rate_schedule = state_initializer(config, mesh, spec)
  state, _, state_mesh_shardings = maxtext_utils.get_abstract_state(config, mesh, init_state_fn, True)
  with nn_partitioning.axis_rules(config.logical_axis_rules):
    graphdef = nnx.graphdef(nnx.eval_shape(init_state_fn))
  params_shardings, state_mesh_shardings = sharding.maybe_update_params_sharding_with_opt(config, state_mesh_shardings)
  p_train_step, p_eval_step = _jit_steps(
      spec, config, graphdef, state_mesh_shardings, params_shardings, frozen, data_sharding, eval_data_sharding
  )
  return TrainedModel(
      spec=spec,
      config=config,
      mesh=mesh,
      graphdef=graphdef,
      state=state,
      state_mesh_shardings=state_mesh_shardings,
      checkpoint_manager=None,
      learning_rate_schedule=learning_rate_schedule,
      trainable=trainable_filter(config, spec),
      p_train_step=p_train_step,
      p_eval_step=p_eval_step,
      start_step=0,
  )

"""The one generic training loop: MaxText's setup, an objective's loss, MaxText's checkpointing and logging.

Everything model-shaped comes from MaxText: the mesh (`ici_*`/`dcn_*`), model creation and sharding rules,
optimizer and learning-rate schedule, gradient clipping and accumulation, orbax checkpointing (auto-resume,
`load_parameters_path`), the jitted step's shardings and donation, and the metric logger (TensorBoard and
`metrics_file`). The objective (`posttrain_mode`) supplies data, loss, hooks and extra evaluation; this module
contains nothing objective-specific.
"""

import dataclasses
import datetime
import json
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import partitioning as nn_partitioning

from maxtext.common import checkpointing
from maxtext.common import data_loader
from maxtext.common import metric_logger
from maxtext.common import train_state_nnx
from maxtext.utils import gradient_accumulation
from maxtext.utils import max_logging
from maxtext.utils import max_utils
from maxtext.utils import maxtext_utils
from maxtext.utils import model_creation_utils
from maxtext.utils import sharding
from maxtext.utils import train_utils

from maxtext_posttrain import checkpoint_guard
from maxtext_posttrain import config as config_lib
from maxtext_posttrain import manifest
from maxtext_posttrain import objectives
from maxtext_posttrain import progress
from maxtext_posttrain import roles as roles_lib
from maxtext_posttrain.peft import lora


@dataclasses.dataclass
class Loop:
  """The state a run carries between steps; objectives' hooks and evaluation read it."""

  config: Any
  mesh: jax.sharding.Mesh
  objective: objectives.Objective
  graphdef: nnx.GraphDef  # of TrainStateNNX
  state: nnx.State  # pure state of TrainStateNNX: {"model": ..., "optimizer": ...}
  state_mesh_shardings: nnx.State
  checkpoint_manager: Any
  data: objectives.ObjectiveData
  train_batches: data_loader.DataLoader  # MaxText's loader: places `data.train` batches on the input sharding
  learning_rate_schedule: Any
  p_train_step: Any
  p_eval_step: Any
  step: int
  start_step: int
  roles: dict[str, roles_lib.FrozenModel] = dataclasses.field(default_factory=dict)
  cache: dict[str, Any] = dataclasses.field(default_factory=dict)  # objective-owned objects (e.g. a sampler)

  def policy(self) -> nnx.Module:
    """The policy model with the current weights (shares the arrays of `state`, no copy)."""
    return nnx.merge(self.graphdef, self.state).model

  def role(self, name: str) -> roles_lib.FrozenModel:
    """A frozen role of the objective; under LoRA the reference is the current policy with its starting adapters."""
    if name not in self.roles:
      raise ValueError(f"posttrain_mode={self.objective.name} declared roles {list(self.roles)}, not {name!r}.")
    role = self.roles[name]
    return role.follow(self.policy()) if role.follows_policy else role


def _accumulated_adapter_grads(objective, config, model, batch):
  """(loss, weight, metric sums, adapter grads) accumulated over microbatches, for LoRA and QLoRA.

  MaxText's accumulation differentiates every `nnx.Param`, which under LoRA is the frozen base too (under QLoRA its
  integer codes, which have no gradient). This differentiates the adapters only, over the microbatches MaxText
  forms (row r of the batch goes to microbatch r % steps), summing (total, weight, metrics, grads) and dividing by
  the weight of the whole batch, as MaxText does. The model's RNG state is not advanced between microbatches.
  """
  steps = config.gradient_accumulation_steps
  graphdef, params, rest = nnx.split(model, lora.trainable(config), ...)
  data = jax.tree.map(lambda x: jnp.swapaxes(x.reshape((x.shape[0] // steps, steps) + x.shape[1:]), 0, 1), batch)

  def summed(params, microbatch):
    out = objective.loss(nnx.merge(graphdef, params, rest, copy=True), microbatch, True)
    return out.total, out

  def accumulate(sums, microbatch):
    (_, out), grads = jax.value_and_grad(summed, has_aux=True)(params, microbatch)
    return jax.tree.map(jnp.add, sums, (grads, out)), None

  out_shapes = jax.eval_shape(lambda m: summed(params, m)[1], jax.tree.map(lambda x: x[0], data))
  zeros = (jax.tree.map(jnp.zeros_like, params), jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shapes))
  (grads, out), _ = jax.lax.scan(accumulate, zeros, data)
  weight = jnp.maximum(out.weight, 1.0)
  return out.total / weight, out.weight, out.metrics, jax.tree.map(lambda g: g / weight, grads)


def _loss_and_grads(objective, config, model, params_shardings, batch):
  """(loss, weight, metric sums, raw grads) of the objective, with MaxText's gradient accumulation when enabled."""
  if config.gradient_accumulation_steps > 1 and lora.enabled(config):
    return _accumulated_adapter_grads(objective, config, model, batch)
  if config.gradient_accumulation_steps > 1:

    # MaxText's accumulation differentiates a summed loss, reading the sum and its weight from `xent_sum` and
    # `total_weights`; it then divides the accumulated gradient by the weight of the whole batch.
    def summed_loss(model, config, data, dropout_rng, params, is_train=True):
      del config, dropout_rng, params
      out = objective.loss(model, data, is_train)
      aux = {"xent_sum": out.total, "total_weights": out.weight, "metrics": out.metrics}
      aux |= {"moe_lb_loss": 0.0, "indexer_loss": 0.0, "mtp_loss": 0.0}
      return out.total, aux

    loss, aux, grads = gradient_accumulation.gradient_accumulation_loss_and_grad(
        summed_loss, config, model, None, params_shardings, batch, None
    )
    return loss, aux["total_weights"], aux["metrics"], grads

  # Under LoRA only the adapters are differentiated; the frozen (maybe quantized) base rides along in `rest`.
  model_graphdef, params, rest = nnx.split(model, lora.trainable(config), ...)

  def mean_loss(params):
    local_model = nnx.merge(model_graphdef, params, rest, copy=True)
    out = objective.loss(local_model, batch, True)
    return out.total / jnp.maximum(out.weight, 1.0), (out, nnx.state(local_model, nnx.Not(nnx.Param)))

  (loss, (out, new_rest)), grads = jax.value_and_grad(mean_loss, has_aux=True)(params)
  nnx.update(model, new_rest)
  return loss, out.weight, out.metrics, grads


class MetricLogger(metric_logger.MetricLogger):
  """MaxText's logger, except that `metrics_file` is emptied once per fresh run rather than whenever a row for
  step 0 is written, so the evaluation before the first step stays in the file, and that the per-step line shows
  the objective's own figures after the loss."""

  def __init__(self, config, learning_rate_schedule, objective: objectives.Objective, start_step=0):
    super().__init__(config, learning_rate_schedule, start_step)
    self.objective = objective
    if config.metrics_file and start_step == 0 and jax.process_index() == 0:
      open(config.metrics_file, "w", encoding="utf-8").close()

  def _log_training_metrics(self, metrics, step):
    """MaxText's per-step line (step, seconds, TFLOP/s and tokens/s per device, total_weights, loss), then the
    objective's headline figures in place of MaxText's `lm_loss` and `perplexity`, which read 0 for a loss that is
    not a language-model cross entropy (preference and RL losses)."""
    scalars = metrics["scalar"]
    figures = {"loss": float(scalars["learning/loss"])} | self.objective.headline_metrics(scalars)
    max_logging.log(
        f"completed step: {step}, seconds: {scalars['perf/step_time_seconds']:.3f}, "
        f"TFLOP/s/device: {scalars['perf/per_device_tflops_per_sec']:.3f}, "
        f"Tokens/s/device: {scalars['perf/per_device_tokens_per_sec']:.3f}, "
        f"total_weights: {scalars['learning/total_weights']}, "
        + ", ".join(f"{name}: {value:.3f}" for name, value in figures.items())
    )

  def write_scalars(self, scalars: dict[str, float], step: int, metric_type: str) -> None:
    """Rows outside MaxText's train/eval schema (our evaluations, data counts): TensorBoard and metrics_file."""
    if self.config.enable_tensorboard:
      self.write_metrics_to_tensorboard({"scalar": scalars}, step, metric_type)
    if self.config.metrics_file:
      self.write_metrics_locally({"scalar": scalars}, step)

  def write_metrics_locally(self, metrics, step):
    with open(self.config.metrics_file, "a", encoding="utf-8") as f:
      row = metric_logger._prepare_metrics_for_json(metrics, step, self.config.run_name)  # pylint: disable=protected-access
      f.write(json.dumps(row) + "\n")


def make_train_step(objective):
  """A train step with MaxText's signature, so MaxText's `jit_train_step` supplies shardings and donation."""

  def train_step(graphdef, config, state_mesh_shardings, params_shardings, state, data, dropout_rng=None):
    del state_mesh_shardings, dropout_rng
    train_state = nnx.merge(graphdef, state)
    nnx.pop(train_state.model, nnx.Intermediate)
    loss, weight, metric_sums, raw_grads = _loss_and_grads(objective, config, train_state.model, params_shardings, data)
    raw_grads = jax.tree.map(lambda g: g.astype(config.grad_dtype) if g.dtype == jnp.float32 else g, raw_grads)
    if config.gradient_clipping_threshold > 0:
      grads = maxtext_utils.apply_gradient_clipping(raw_grads, None, config.gradient_clipping_threshold)
    else:
      grads = raw_grads
    if config.skip_step_on_spikes:  # MaxText's spike-skipping optimizer reads the loss and gradient norm
      train_state.apply_gradients(grads, loss=loss, grad_norm=max_utils.l2norm_pytree(grads))
    else:
      train_state.apply_gradients(grads)
    scalars = {
        "learning/loss": loss,
        "learning/total_weights": weight,
        "learning/grad_norm": max_utils.l2norm_pytree(grads),
        "learning/raw_grad_norm": max_utils.l2norm_pytree(raw_grads),
        "learning/param_norm": max_utils.l2norm_pytree(nnx.state(train_state.model, lora.trainable(config))),
    }
    scalars |= {f"learning/{k}": v / jnp.maximum(weight, 1.0) for k, v in metric_sums.items()}
    return nnx.state(train_state, nnx.Not(nnx.Intermediate)), {"scalar": scalars, "scalars": {}}

  return train_step


def make_eval_step(objective):
  """An eval step with MaxText's signature, returning the (total, weight) of the objective's loss on one batch."""

  def eval_step(graphdef, config, state, data, dropout_rng=None):
    del config, dropout_rng
    out = objective.loss(nnx.merge(graphdef, state).model, data, False)
    scalars = {"evaluation/total_loss": out.total, "evaluation/total_weights": out.weight}
    return {"scalar": scalars | {f"evaluation/metrics/{k}": v for k, v in out.metrics.items()}}

  return eval_step


# MaxText training features that this loop's step does not carry yet; each fails at start instead of being ignored.
_UNSUPPORTED = (
    (lambda c: c.num_experts > 1, "mixture-of-experts models (num_experts > 1): their load-balance loss"),
    (lambda c: c.mtp_num_layers > 0, "multi-token prediction (mtp_num_layers > 0)"),
    (lambda c: c.use_indexer, "the attention indexer (use_indexer)"),
    (lambda c: c.num_vocab_tiling > 1, "vocabulary tiling (num_vocab_tiling > 1)"),
    (lambda c: c.quantization in ("fp8", "nanoo_fp8"), "fp8 training (quantization=fp8/nanoo_fp8): its amax state"),
    (lambda c: c.parameter_memory_host_offload, "parameter_memory_host_offload"),
    (lambda c: c.optimizer_memory_host_offload, "optimizer_memory_host_offload"),
    (lambda c: c.shard_optimizer_over_data, "shard_optimizer_over_data (ZeRO-1)"),
    (lambda c: c.enable_diloco, "DiLoCo (enable_diloco)"),
    (lambda c: c.use_qk_clip, "QK-clip (use_qk_clip)"),
)


def check_supported(config) -> None:
  """Raises ValueError naming every enabled MaxText training feature that the post-training step lacks."""
  enabled = [name for applies, name in _UNSUPPORTED if applies(config)]
  if enabled:
    raise ValueError("The post-training loop does not support yet: " + "; ".join(enabled) + ".")


def _eval_data_sharding(config, mesh):
  return sharding.get_input_data_sharding(config, mesh, rules=config.logical_axis_rules_for_eval)


def state_initializer(config, mesh) -> tuple[Callable[[], train_state_nnx.TrainStateNNX], Any]:
  """(init_state_fn, learning-rate schedule): the policy (with its adapters under LoRA) and an optimizer over what
  it trains, as MaxText's `setup_training_state` and `nnx.eval_shape` take it."""
  create_model, abstract_model = model_creation_utils.create_nnx_abstract_model(config, mesh)
  learning_rate_schedule, tx = train_utils.create_training_optimizer(config, abstract_model, mesh=mesh)

  def init_state_fn():
    model = lora.apply(create_model(), config)  # the policy as is when LoRA is off
    return train_state_nnx.TrainStateNNX(model, nnx.Optimizer(model, tx, wrt=lora.trainable(config)))

  return init_state_fn, learning_rate_schedule


def setup(config) -> Loop:
  """Builds the mesh, model, optimizer, checkpointing, data and jitted steps; restores or initialises the state."""
  objective_class = objectives.get(config.posttrain_mode)  # first: fails listing the registered modes
  check_supported(config)
  lora.validate_config(config)
  objective = objective_class(config)
  mesh = maxtext_utils.get_mesh_from_config(config)
  roles = {role: roles_lib.build(role, config, mesh) for role in objective.roles}
  init_state_fn, learning_rate_schedule = state_initializer(config, mesh)
  with nn_partitioning.axis_rules(config.logical_axis_rules):
    abstract_state = nnx.eval_shape(init_state_fn)
  checkpoint_manager = train_utils.create_checkpoint_manager(config, mesh, init_state_fn)
  checkpoint_guard.check_compatible(checkpoint_manager, abstract_state, adapters_only=lora.enabled(config))
  if lora.enabled(config):
    checkpoint_guard.check_same_adapter_source(checkpoint_manager, config)
    resuming = checkpoint_manager is not None and checkpointing.latest_step(checkpoint_manager) is not None
    if config.lora.lora_restore_path and not resuming:
      lora.check_restore_source(nnx.state(abstract_state.model, nnx.LoRAParam), config)  # before weights load
  data = objective.make_data(mesh)
  # QLoRA's state holds quantized codes, which MaxText's loader cannot fill from a full-precision checkpoint:
  # `lora.reload_base` quantizes the checkpoint's weights instead, at the start as on every resume.
  quantized_base = lora.enabled(config) and bool(config.lora.lora_weight_qtype) and bool(config.load_parameters_path)
  setup_config = config_lib.with_overrides(config, load_parameters_path="") if quantized_base else config
  state, _, state_mesh_shardings, data.train, _ = maxtext_utils.setup_training_state(
      data.train, setup_config, mesh, checkpoint_manager, init_state_fn
  )
  start_step = int(state.optimizer.step.get_value())
  train_utils.validate_completed_steps(start_step, config.steps)
  if (start_step > 0 or quantized_base) and lora.enabled(config) and config.load_parameters_path:
    state = lora.reload_base(state, config, mesh)
  if config.lora.lora_restore_path and start_step == 0:  # as in MaxText: a resumed run reads its own adapters
    state = lora.restore_adapters(state, config)
  graphdef = nnx.graphdef(abstract_state)
  params_shardings, state_mesh_shardings = sharding.maybe_update_params_sharding_with_opt(config, state_mesh_shardings)
  data_sharding = sharding.get_input_data_sharding(config, mesh)
  p_train_step = train_utils.jit_train_step(
      config,
      graphdef,
      state,
      state_mesh_shardings,
      data_sharding,
      make_train_step(objective),
      params_shardings,
      mesh=mesh,
  )
  p_eval_step = None
  if data.eval is not None:
    p_eval_step = train_utils.jit_eval_step(
        config, graphdef, state_mesh_shardings, _eval_data_sharding(config, mesh), make_eval_step(objective)
    )
  manifest.write(config, data.description, start_step, mesh)
  return Loop(
      config=config,
      mesh=mesh,
      objective=objective,
      graphdef=graphdef,
      state=state,
      state_mesh_shardings=state_mesh_shardings,
      checkpoint_manager=checkpoint_manager,
      data=data,
      train_batches=data_loader.DataLoader(config, mesh, data.train, None),
      learning_rate_schedule=learning_rate_schedule,
      p_train_step=p_train_step,
      p_eval_step=p_eval_step,
      step=start_step,
      start_step=start_step,
      roles=roles,
  )


def evaluate(loop: Loop, logger: MetricLogger | None = None) -> dict[str, float]:
  """Held-out loss over `eval_steps` batches plus the objective's own evaluation; logs and returns the scalars."""
  config = loop.config
  results = {}
  if loop.p_eval_step is not None:
    sums = {}  # summed on device; read once after the last batch
    loop.data.eval.reset()
    for eval_count, batch in enumerate(loop.data.eval):
      batch = loop.objective.before_eval_step(loop, jax.device_put(batch, _eval_data_sharding(config, loop.mesh)))
      with jax.set_mesh(loop.mesh), nn_partitioning.axis_rules(config.logical_axis_rules_for_eval):
        scalars = loop.p_eval_step(loop.state, batch)["scalar"]
      sums = {k: sums.get(k, 0.0) + v for k, v in scalars.items()}
      if 0 < config.eval_steps <= eval_count + 1:
        break
    weight = max(float(sums.pop("evaluation/total_weights")), 1.0)
    results["eval/loss"] = float(sums.pop("evaluation/total_loss")) / weight
    results |= {"eval/" + k.removeprefix("evaluation/metrics/"): float(v) / weight for k, v in sums.items()}
  results |= loop.objective.evaluate(loop)
  max_logging.log(f"[eval after {loop.step} steps] " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(results.items())))
  if logger is not None:
    logger.write_scalars(results, loop.step, "eval")
  return results


def _check_batch_keys(objective: objectives.Objective, batch: dict) -> None:
  missing = sorted(set(objective.batch_keys) - set(batch))
  if missing:
    raise ValueError(f"posttrain_mode={objective.name}: batches lack {missing} (they carry {sorted(batch)}).")


def _numeric_leaves(tree: dict, prefix: str) -> dict[str, float]:
  """`{"train": {"num_truncated": 3}}` -> `{"<prefix>/train/num_truncated": 3.0}`; strings are skipped."""
  flat = {}
  for key, value in tree.items():
    name = f"{prefix}/{key}"
    if isinstance(value, dict):
      flat |= _numeric_leaves(value, name)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
      flat[name] = float(value)
  return flat


def train(loop: Loop) -> dict[str, Any]:
  """Runs steps `loop.step .. config.steps`, evaluating every `eval_interval` steps; returns a summary."""
  config = loop.config
  logger = MetricLogger(config, loop.learning_rate_schedule, loop.objective, start_step=loop.start_step)
  logger.write_setup_info_to_tensorboard(loop.state.model.filter(nnx.Param))
  # Example counts (truncated, skipped, tokens) of each split, so they sit beside the curves they explain.
  logger.write_scalars(_numeric_leaves(loop.data.description, "data"), loop.step, "data")
  eval_due = config.eval_interval > 0
  summary = {"start_step": loop.start_step, "evals": {}}
  if eval_due and loop.step == 0:
    summary["evals"][0] = evaluate(loop, logger)
  tokens_per_step = config.global_batch_size_to_train_on * loop.objective.rows_per_example * config.max_target_length
  meter = progress.Progress(config.steps, loop.start_step, tokens_per_step)
  last_step_end = datetime.datetime.now()
  try:
    while loop.step < config.steps:
      step = loop.step
      batch = loop.train_batches.load_next_batch() if loop.objective.wants_batch(loop) else None
      batch = loop.objective.before_step(loop, batch)
      if step == loop.start_step:
        _check_batch_keys(loop.objective, batch)
      with jax.set_mesh(loop.mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
        loop.state, metrics = loop.p_train_step(loop.state, batch)
      now = datetime.datetime.now()
      step_time, last_step_end = now - last_step_end, now
      loop.step = step + 1
      checkpointing.maybe_save_checkpoint(loop.checkpoint_manager, loop.state, config, loop.data.train, step)
      loop.objective.after_step(loop, step, metrics)
      reached_target = False
      if eval_due and loop.step % config.eval_interval == 0:
        results = summary["evals"][loop.step] = evaluate(loop, logger)
        reached_target = 0 < results.get("eval/loss", float("inf")) <= config.target_eval_loss
      logger.buffer_and_write_metrics(metrics, step, step_time)
      if loop.step % config.log_period == 0 or loop.step == config.steps or reached_target:
        scalars = metrics["scalar"]
        meter.report(loop.step, float(scalars["learning/loss"]), loop.objective.headline_metrics(scalars))
      if reached_target:
        max_logging.log(
            f"Stopping after {loop.step} steps: eval/loss reached target_eval_loss={config.target_eval_loss}."
        )
        break
    if config.save_checkpoint_on_completion:
      checkpointing.maybe_save_checkpoint(loop.checkpoint_manager, loop.state, config, loop.data.train)
    if loop.checkpoint_manager is not None:
      checkpointing.wait_until_finished(loop.checkpoint_manager)
  finally:
    logger.flush_metrics_and_cleanup()
  summary["end_step"] = loop.step
  summary["seconds"] = meter.elapsed()
  return summary

"""The one generic training loop: MaxText's setup, the objective's roles and losses, MaxText's checkpointing and logging.

The loop trains the set of MaxText models its objective declares (`roles.RoleSpec`): every trained role is a
`trained_model.TrainedModel` (MaxText's model creation and sharding rules, optimizer and schedule, orbax
checkpoints with auto-resume and `load_parameters_path`, a jitted step with MaxText's shardings and donation), every
frozen role a `roles.FrozenModel`. The first trained role is the primary one (the policy, or the reward model a
reward-model run trains): its checkpoints are `<run>/checkpoints`, its data iterator state is saved with them, and
its loss is the one MaxText's logger shows; other trained roles checkpoint in `<run>/<role>/checkpoints` at the same
steps and auto-resume with it. An objective's host-side state (an adaptive KL coefficient) is saved beside them.
The objective supplies data, losses, hooks and extra evaluation; this module contains nothing objective-specific.
"""

import dataclasses
import datetime
import json
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from maxtext.common import data_loader
from maxtext.common import metric_logger
from maxtext.utils import max_logging
from maxtext.utils import sharding

from maxtext_posttrain import cli
from maxtext_posttrain import config as config_lib
from maxtext_posttrain import layer_transfer
from maxtext_posttrain import load_balance
from maxtext_posttrain import manifest
from maxtext_posttrain import mesh as mesh_lib
from maxtext_posttrain import objective_state
from maxtext_posttrain import objectives
from maxtext_posttrain import progress
from maxtext_posttrain import roles as roles_lib
from maxtext_posttrain import rollout
from maxtext_posttrain import trained_model
from maxtext_posttrain.peft import lora


@dataclasses.dataclass
class Loop:
  """The state a run carries between steps; objectives' hooks and evaluation read it."""

  config: Any
  mesh: jax.sharding.Mesh
  objective: objectives.Objective
  trained: dict[str, trained_model.TrainedModel]  # in the objective's order; the first is the primary role
  frozen: dict[str, roles_lib.FrozenModel]
  data: objectives.ObjectiveData
  train_batches: data_loader.DataLoader  # MaxText's loader: places `data.train` batches on the input sharding
  step: int
  start_step: int
  rollout_mesh: jax.sharding.Mesh  # the sampler's: the trainer's mesh, or devices of its own (rl.off_policy_steps)
  nonfinite_steps: int = 0  # steps skipped under nonfinite_policy=skip, over the whole run (saved with checkpoints)
  cache: dict[str, Any] = dataclasses.field(default_factory=dict)  # objective-owned objects
  _sampler: rollout.Sampler | None = None
  _merge: Callable[[nnx.State], nnx.State] | None = None  # the policy's adapter merge, compiled once (`policy_params`)

  @property
  def primary(self) -> trained_model.TrainedModel:
    """The objective's first trained role: its checkpoints are the run's `<run>/checkpoints`."""
    return next(iter(self.trained.values()))

  def policy(self) -> nnx.Module:
    """The policy model with the current weights (shares the arrays of its state, no copy)."""
    return self.trained[roles_lib.POLICY].model()

  def policy_params(self) -> nnx.State:
    """The policy's current weights as MaxText's decode graphs read them (`lora.policy_params`). Without adapters
    they are read off the train state (the same arrays, no copy) rather than from a model built around the whole
    train state, optimizer included, at every rollout; adapters are merged by one program compiled for the run."""
    if lora.enabled(self.config):
      graphdef, state = nnx.split(self.policy())
      if self._merge is None:
        self._merge = lora.merge_program(graphdef, self.config)
      return self._merge(state)
    return self.trained[roles_lib.POLICY].state.model.filter(lora.DECODED)

  def role(self, name: str) -> roles_lib.FrozenModel:
    """A frozen role; under LoRA the reference is the current policy with its starting adapters."""
    if name not in self.frozen:
      raise ValueError(f"posttrain_mode={self.objective.name} declared frozen roles {list(self.frozen)}, not {name!r}.")
    role = self.frozen[name]
    return role.follow(self.policy()) if role.follows_policy else role

  def frozen_states(self) -> dict[str, nnx.State]:
    """The weights of the frozen roles the jitted steps read, by name (passed in, not donated)."""
    return {name: self.role(name).state for name, role in self.frozen.items() if role.spec.in_step}

  def sampler(self) -> rollout.Sampler:
    """The run's one rollout sampler (MaxText decoding with a KV cache), shared by rollouts and evaluation."""
    if self._sampler is None:
      self._sampler = rollout.Sampler(self.config, self.rollout_mesh)
    return self._sampler


# MaxText training features that this loop's step does not carry yet; each fails at start instead of being ignored.
_UNSUPPORTED = (
    (
        lambda c: c.num_experts > 1 and c.routed_bias and c.routed_bias_update_rate > 0,
        "MoE router-bias updates (routed_bias_update_rate > 0: auxiliary-loss-free load balancing)",
    ),
    (
        lambda c: load_balance.enabled(c) and layer_transfer.enabled(c),
        "layer-transfer distillation (distill_beta > 0 or distill.attention_weight > 0) of an MoE student with "
        "load_balance_loss_weight > 0 (its layer capture collects the routers' losses the step adds)",
    ),
    (lambda c: c.num_experts > 1 and c.moe_dropless_fallback == "step", "moe_dropless_fallback=step (its rollback)"),
    (lambda c: c.mtp_num_layers > 0, "multi-token prediction (mtp_num_layers > 0)"),
    (lambda c: c.use_indexer, "the attention indexer (use_indexer)"),
    (lambda c: c.num_vocab_tiling > 1, "vocabulary tiling (num_vocab_tiling > 1)"),
    (lambda c: c.quantization in ("fp8", "nanoo_fp8"), "fp8 training (quantization=fp8/nanoo_fp8): its amax state"),
    (lambda c: c.parameter_memory_host_offload, "parameter_memory_host_offload"),
    (lambda c: c.optimizer_memory_host_offload, "optimizer_memory_host_offload"),
    (lambda c: c.shard_optimizer_over_data, "shard_optimizer_over_data (ZeRO-1)"),
    (lambda c: c.enable_diloco, "DiLoCo (enable_diloco)"),
    (lambda c: c.use_qk_clip, "QK-clip (use_qk_clip)"),
    # MaxText then saves off `checkpoint_period`, where the objective's state (`objective_state.due`) is not saved.
    (lambda c: c.enable_continuous_checkpointing, "enable_continuous_checkpointing"),
    (lambda c: c.enable_autocheckpoint, "saves at preemption (enable_autocheckpoint)"),
    (lambda c: c.enable_emergency_checkpoint, "local checkpoints (enable_emergency_checkpoint)"),
    (lambda c: c.enable_multi_tier_checkpointing, "local checkpoints (enable_multi_tier_checkpointing)"),
)


def check_supported(config, overrides_key: str | None = None) -> None:
  """Raises ConfigError naming every enabled MaxText training feature that the post-training step lacks (in a
  trained role's config, named by the key of its overrides)."""
  enabled = [name for applies, name in _UNSUPPORTED if applies(config)]
  if enabled:
    where = f"{overrides_key}: " if overrides_key else ""
    raise config_lib.ConfigError(f"{where}The post-training loop does not support yet: " + "; ".join(enabled) + ".")


def _eval_data_sharding(config, mesh):
  return sharding.get_input_data_sharding(config, mesh, rules=config.logical_axis_rules_for_eval)


class MetricLogger(metric_logger.MetricLogger):
  """MaxText's logger, except that `metrics_file` is emptied once per fresh run rather than whenever a row for
  step 0 is written, so the evaluation before the first step stays in the file, and that the per-step line shows
  the objective's own figures after the loss."""

  def __init__(self, config, learning_rate_schedule, objective: objectives.Objective, start_step=0, on_train_row=None):
    super().__init__(config, learning_rate_schedule, start_step)
    self.objective = objective
    self.on_train_row = on_train_row  # (step, metrics) -> None, before a train step's row is written
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

  def write_metrics(self, metrics, step, metric_type="train"):
    """MaxText's writing of a row, after `on_train_row` for a train step's."""
    if metric_type == "train" and self.on_train_row is not None:
      self.on_train_row(step, metrics)
    super().write_metrics(metrics, step, metric_type)

  def flush_buffered(self) -> None:
    """Writes the rows MaxText's logger holds back (it writes step s's row at step s + 1, when reading it no longer
    waits for the device)."""
    while self.buffered_metrics:
      self._flush_one_buffered_entry(self.buffered_metrics.pop(0))

  def write_scalars(self, scalars: dict[str, float], step: int, metric_type: str) -> None:
    """Rows outside MaxText's train/eval schema (our evaluations, data counts): TensorBoard and metrics_file."""
    if self.config.enable_tensorboard:
      self.write_metrics_to_tensorboard({"scalar": scalars}, step, metric_type)
    if self.config.metrics_file:
      self.write_metrics_locally({"scalar": scalars}, step)

  def write_metrics_locally(self, metrics, step):
    if jax.process_index() != 0:  # one file per run, not one row per process
      return
    with open(self.config.metrics_file, "a", encoding="utf-8") as f:
      row = metric_logger._prepare_metrics_for_json(metrics, step, self.config.run_name)  # pylint: disable=protected-access
      f.write(json.dumps(row) + "\n")


def setup(config) -> Loop:
  """Builds the mesh, the objective's roles (frozen, then trained: restored or initialised), data and jitted steps."""
  objective_class = objectives.get(config.posttrain_mode)  # first: fails listing the registered modes
  check_supported(config)
  lora.validate_config(config)
  objective = objective_class(config)
  mesh, rollout_mesh = mesh_lib.trainer_and_rollout_meshes(config, separate=objective.off_policy_steps > 0)
  specs = objective.roles
  frozen = {
      spec.name: roles_lib.build_frozen(spec, config, rollout_mesh if spec.on_rollout_mesh else mesh)
      for spec in specs
      if not spec.trained
  }
  data = objective.make_data(mesh)
  manifest.check_resume(config, data.description)
  data_sharding = sharding.get_input_data_sharding(config, mesh)
  eval_sharding = _eval_data_sharding(config, mesh) if data.eval is not None else None
  trained = {}
  for index, spec in enumerate(s for s in specs if s.trained):
    role_config = roles_lib.role_config(config, spec, primary=index == 0)
    if index:  # the primary role's config is the run's, checked above
      check_supported(role_config, spec.overrides_key)
    # The primary role's checkpoints carry the data iterator's state; the others restore none, and resume at its step.
    iterator = data.train if index == 0 else None
    primary_latest = None if index == 0 else next(iter(trained.values())).latest_step()
    resume_at = None if index == 0 else -1 if primary_latest is None else primary_latest
    trained[spec.name], iterator = trained_model.build(
        spec, role_config, mesh, iterator, frozen, data_sharding, eval_sharding if index == 0 else None, resume_at
    )
    if index == 0:
      data.train = iterator
  if next(iter(trained.values())).start_step == config.steps:
    max_logging.log(
        f"The run has completed its steps={config.steps} (checkpoints of step {config.steps - 1}): "
        "nothing to train. Set steps higher to continue it."
    )
  start_step = _common_start_step(trained)
  host_state, nonfinite_steps = objective_state.split_loop_state(objective_state.restore(config, start_step))
  objective.load_host_state(host_state)
  manifest.write(config, data.description, start_step, mesh)
  return Loop(
      config=config,
      mesh=mesh,
      objective=objective,
      trained=trained,
      frozen=frozen,
      data=data,
      train_batches=data_loader.DataLoader(config, mesh, data.train, None),
      step=start_step,
      start_step=start_step,
      rollout_mesh=rollout_mesh,
      nonfinite_steps=nonfinite_steps,
  )


def _common_start_step(trained: dict[str, trained_model.TrainedModel]) -> int:
  """The step every trained role resumes at; raises ValueError naming their checkpoint steps if they differ (a role
  behind the primary one: its checkpoints were removed) rather than pairing models of different steps. A role ahead
  of the primary (a run killed between the roles' saves: the primary saves last) was brought back by `build`."""
  steps = {name: model.start_step for name, model in trained.items()}
  if len(set(steps.values())) > 1:
    listed = ", ".join(
        f"{name} at step {step - 1} ({model.config.checkpoint_dir})"
        for (name, step), model in zip(steps.items(), trained.values())
    )
    raise ValueError(
        f"The trained roles' latest checkpoints differ: {listed}. Remove the newer step directories so that all "
        "roles resume from the same step."
    )
  return next(iter(steps.values()))


def evaluate(loop: Loop, logger: MetricLogger | None = None) -> dict[str, float]:
  """Held-out loss over `eval_steps` batches plus the objective's own evaluation; logs and returns the scalars."""
  config = loop.config
  results = {}
  primary = loop.primary
  if primary.p_eval_step is not None:
    sums = {}  # summed on device; read once after the last batch
    loop.data.eval.reset()
    for eval_count, batch in enumerate(loop.data.eval):
      batch = loop.objective.before_eval_step(loop, jax.device_put(batch, _eval_data_sharding(config, loop.mesh)))
      scalars = primary.eval_step(batch, loop.frozen_states())["scalar"]
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


def _train_step(loop: Loop, batch) -> tuple[dict[str, Any], bool]:
  """One step of every trained role the objective trains at this step, on the same batch. Returns the metrics (the
  primary role's as MaxText's logger reads them, each other role's under `<role>/`) and whether the primary role
  trained (not in PPO's critic warm-up). With more than one trained role each role's step is timed
  (`perf/<role>_train_seconds`), which waits for its result."""
  frozen_states = loop.frozen_states()
  metrics = {"scalar": {}, "scalars": {}}
  timed = len(loop.trained) > 1
  primary_trained = False
  for name, model in loop.trained.items():
    if not loop.objective.trains(name, loop.step):
      continue
    start = time.perf_counter()
    role_metrics = model.train_step(batch, frozen_states)
    if timed:
      jax.block_until_ready(role_metrics)
    if model is loop.primary:
      metrics["scalar"].update(role_metrics["scalar"])
      primary_trained = True
    else:
      metrics["scalar"].update({f"{name}/{k.split('/', 1)[-1]}": v for k, v in role_metrics["scalar"].items()})
    if timed:
      metrics["scalar"][f"perf/{name}_train_seconds"] = time.perf_counter() - start
  return metrics, primary_trained


class NonFiniteStep(cli.Failure):
  """A step whose loss or gradient norm was NaN or infinite, under nonfinite_policy=stop."""


_MAX_NAMED_EXAMPLES = 16


def _check_finite(loop: Loop, step: int, metrics: dict[str, Any], batch) -> None:
  """Reads step `step`'s non-finite flags (one per trained role); under nonfinite_policy=stop raises NonFiniteStep if
  one is set, under skip counts the step. Sets the step's `learning/nonfinite_steps` (skipped so far, this one
  included) in its metrics row.

  It runs as the step's row is written (MetricLogger.on_train_row): one step late, when MaxText's logger reads a
  step's metrics, or before the step's checkpoint is saved (`_save` writes the rows first), so it adds no wait on
  the device; no checkpoint holds a non-finite step. (Reading the flags right after the step's dispatch deadlocked
  XLA:CPU's collectives on 4 fake devices.)"""
  flags = [k for k, v in metrics["scalar"].items() if k.rsplit("/", 1)[-1] == "nonfinite" and float(v)]
  if flags:
    if loop.config.nonfinite_policy == "stop":
      _stop_nonfinite(loop, step, metrics, batch)
    loop.nonfinite_steps += 1
    max_logging.log(f"Step {step}: non-finite loss or gradient; update skipped ({loop.nonfinite_steps} so far).")
  metrics["scalar"]["learning/nonfinite_steps"] = float(loop.nonfinite_steps)


def _stop_nonfinite(loop: Loop, step: int, metrics: dict[str, Any], batch) -> None:
  """Raises NonFiniteStep naming the step, every non-finite figure it logged and the examples it trained on."""
  figures = ", ".join(f"{k}={float(v)}" for k, v in metrics["scalar"].items() if not np.isfinite(float(v)))
  examples = loop.objective.step_examples(step, batch)
  named = ", ".join(map(str, examples[:_MAX_NAMED_EXAMPLES])) + (
      f" and {len(examples) - _MAX_NAMED_EXAMPLES} more" if len(examples) > _MAX_NAMED_EXAMPLES else ""
  )
  latest = loop.primary.latest_step()
  kept = "No checkpoint was saved yet" if latest is None else f"The latest checkpoint is step {latest}'s"
  raise NonFiniteStep(
      f"Step {step}: non-finite {figures or 'gradient'}; the step trained on {loop.objective.example_unit} "
      f"[{named or 'none read'}] of the train split (process {jax.process_index()}). {kept}, from before it: no "
      "checkpoint holds a non-finite step. nonfinite_policy=skip goes on without such steps."
  )


def _save(loop: Loop, logger: MetricLogger, step: int, final: bool = False) -> None:
  """Saves the objective's host state, then every trained role at `step`, the primary role last (with the data
  iterator), so a run killed between saves leaves the primary role's latest step complete in every role.

  Every metrics row up to `step` (MaxText's logger holds the last one back) is written first: a run resumed from
  this checkpoint starts logging at `step + 1`, so a row still held back when the run was killed would be lost."""
  if objective_state.due(loop.config, step, final):
    logger.flush_buffered()
    state = objective_state.with_loop_state(loop.objective.host_state(step), loop)
    objective_state.save(loop.config, step, state, final, loop.objective.host_rows(step))
  models = list(loop.trained.values())
  for model in models[1:] + models[:1]:
    model.save(step, loop.data.train if model is loop.primary else None, final)
  if objective_state.due(loop.config, step, final):
    objective_state.prune_rows(loop.config, loop.primary.saved_steps() | {step})


def train(loop: Loop) -> dict[str, Any]:
  """Runs steps `loop.step .. config.steps`, evaluating every `eval_interval` steps; returns a summary."""
  config = loop.config
  primary = loop.primary
  batches = {}  # step -> the batch it trained on, until its row is written and its non-finite flags checked

  def check(step, metrics):
    _check_finite(loop, step, metrics, batches.pop(step, None))

  logger = MetricLogger(config, primary.learning_rate_schedule, loop.objective, loop.start_step, check)
  logger.write_setup_info_to_tensorboard(primary.state.model.filter(nnx.Param))
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
      metrics, primary_trained = _train_step(loop, batch)
      batches[step] = batch
      now = datetime.datetime.now()
      step_time, last_step_end = now - last_step_end, now
      loop.step = step + 1
      loop.objective.after_step(loop, step, metrics)
      reached_target = False
      if eval_due and loop.step % config.eval_interval == 0:
        results = summary["evals"][loop.step] = evaluate(loop, logger)
        reached_target = 0 < results.get("eval/loss", float("inf")) <= config.target_eval_loss
      if primary_trained:
        logger.buffer_and_write_metrics(metrics, step, step_time)
      else:  # MaxText's row needs the primary role's loss: the other roles' figures go in a row of their own
        check(step, metrics)
        logger.write_scalars({k: float(v) for k, v in metrics["scalar"].items()}, step, "train")
      _save(loop, logger, step)
      if loop.step % config.log_period == 0 or loop.step == config.steps or reached_target:
        scalars = metrics["scalar"]
        loss = float(scalars["learning/loss"]) if primary_trained else None
        meter.report(loop.step, loss, loop.objective.headline_metrics(scalars), warm_up=not primary_trained)
      if reached_target:
        max_logging.log(
            f"Stopping after {loop.step} steps: eval/loss reached target_eval_loss={config.target_eval_loss}."
        )
        break
    logger.flush_buffered()  # the last step's row, and its check, before the final save
    last = loop.step - 1  # saved already when it fell on the period
    if config.save_checkpoint_on_completion and loop.step > loop.start_step and not objective_state.due(config, last):
      _save(loop, logger, last, final=True)
    for model in loop.trained.values():
      model.wait_until_finished()
  except BaseException:
    try:
      logger.flush_metrics_and_cleanup()
    except Exception as cleanup_error:  # pylint: disable=broad-exception-caught
      # The run's own error is the one to report: a full disk that failed a save fails the metric writers' close too.
      max_logging.log(f"Closing the metric writers failed as well: {cleanup_error!r}")
    raise
  logger.flush_metrics_and_cleanup()
  summary["end_step"] = loop.step
  summary["seconds"] = meter.elapsed()
  return summary

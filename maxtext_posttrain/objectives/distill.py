"""Knowledge distillation: the student (the policy) trained on a frozen teacher's token distributions and the labels.

`posttrain_mode=distill` (`distill.yml`) reads SFT's data with SFT's conventions (completion-only targets, packing)
and MaxText's distillation keys, which keep their meaning. The teacher is a frozen role built as MaxText's
`train_distill` builds it: the yml plus `teacher_overrides` (the command line's keys are the student's), typically a
larger model with its own `load_parameters_path`, reading the student's tokens. The student is the run's config, with
`student_overrides` on top. On every completion token of a batch:

  loss = alpha * T^2 * D(teacher_T || student_T) + (1 - alpha) * CE(student, labels)

with alpha = `distill_alpha` and T = `distill_temperature`, each annealed by its `*_end` / `*_schedule` over `steps`
as in MaxText, and D = `distill.divergence`: forward KL (MaxText's), reverse KL or the generalized JSD with
`distill.jsd_beta`. With `distill.top_k` the teacher is kept as its k most likely tokens plus their remaining mass.
The teacher runs inside the jitted train and eval steps (its weights passed in, not donated); the schedules' values
at the step reach the loss as batch arrays, as PPO's KL coefficient does, so one compiled step serves every step.

With MaxText's `offline_data_dir` the teacher is not built at all: its top-k distribution at every distilled token
was written once by `python -m maxtext_posttrain.score_teacher` (`data.teacher_logits`) and comes with each batch,
packed with its tokens; the loss is then the online top-k loss on the same numbers.
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from maxtext_posttrain import config as config_lib
from maxtext_posttrain import forward
from maxtext_posttrain import layer_capture
from maxtext_posttrain import layer_transfer
from maxtext_posttrain import roles
from maxtext_posttrain.data import pipeline
from maxtext_posttrain.data import teacher_logits
from maxtext_posttrain.losses import cross_entropy
from maxtext_posttrain.losses import distillation
from maxtext_posttrain.objectives.base import LossOutput, ObjectiveData, register
from maxtext_posttrain.objectives.sft import SFT
from maxtext_posttrain.peft import lora

ALPHA_KEY = "distill_alpha"
TEMPERATURE_KEY = "distill_temperature"
# The layer-transfer loss terms (`layer_transfer`), logged as learning/<name> when the loss has them.
_TRANSFER = ("feature_loss", "attention_loss")


def check_config(config) -> None:
  """Raises ValueError naming the key for distillation settings this objective cannot honour."""
  for key in (ALPHA_KEY, f"{ALPHA_KEY}_end"):
    value = getattr(config, key)
    if value is not None and not 0.0 <= value <= 1.0:
      raise config_lib.ConfigError(f"{key}={value}: the soft term's weight must be in [0, 1].")
  for key in (TEMPERATURE_KEY, f"{TEMPERATURE_KEY}_end"):
    value = getattr(config, key)
    if value is not None and value <= 0.0:
      raise config_lib.ConfigError(f"{key}={value}: the temperature must be > 0.")
  transfer = layer_transfer.enabled(config) or config.distill_layer_indices
  if transfer and (config.posttrain_mode != "distill" or config.offline_data_dir):
    raise config_lib.ConfigError(
        "distill_beta, distill.attention_weight and distill_layer_indices (feature and attention transfer) need the "
        f"teacher's layers, which posttrain_mode={config.posttrain_mode} with offline_data_dir="
        f"{config.offline_data_dir or 'unset'} does not run: use posttrain_mode=distill with the teacher online."
    )
  if config.offline_data_dir and config.posttrain_mode != "distill":
    raise config_lib.ConfigError(
        f"offline_data_dir={config.offline_data_dir}: offline teacher files serve posttrain_mode=distill; "
        f"posttrain_mode={config.posttrain_mode} scores samples nobody has seen, with the teacher online."
    )
  top_k = config_lib.distill(config).top_k
  if top_k > config.vocab_size:
    raise config_lib.ConfigError(f"distill.top_k={top_k} exceeds vocab_size={config.vocab_size}.")


def schedule_values(config, step: int) -> dict[str, float]:
  """distill_alpha, distill_temperature and distill_beta at `step`, by MaxText's distill_*_end / distill_*_schedule
  keys."""
  return {
      key: float(
          distillation.compute_schedule(
              step, config.steps, getattr(config, key), getattr(config, f"{key}_end"), getattr(config, f"{key}_schedule")
          )
      )
      for key in (ALPHA_KEY, TEMPERATURE_KEY, layer_transfer.BETA_KEY)
  }


def soft_loss(section, student_logits, teacher_logits, mask, temperature) -> distillation.DistillationLoss:
  """T^2 x `section.divergence` of the student from the teacher (its top-k with `section.top_k`) on `mask`."""
  divergence, beta = section.divergence, section.jsd_beta
  if section.top_k:
    teacher = distillation.teacher_top_k(teacher_logits, section.top_k, temperature)
    return distillation.sparse_logit_loss(student_logits, *teacher, mask, divergence, temperature, beta)
  return distillation.logit_loss(student_logits, teacher_logits, mask, divergence, temperature, beta)


@register
class Distill(SFT):
  """`posttrain_mode=distill`: SFT's data and evaluation, with the teacher's soft targets mixed into the loss."""

  name = "distill"
  batch_keys = SFT.batch_keys + (ALPHA_KEY, TEMPERATURE_KEY, layer_transfer.BETA_KEY)

  def __init__(self, config):
    super().__init__(config)
    check_config(config)
    self.section = config_lib.distill(config)
    if self.section.on_policy_fraction:
      raise config_lib.ConfigError(
          f"distill.on_policy_fraction={self.section.on_policy_fraction}: posttrain_mode=distill trains on the "
          "dataset's completions only; posttrain_mode=distill_on_policy samples the student's own."
      )
    self.offline = bool(config.offline_data_dir)
    if self.offline:
      self.batch_keys = self.batch_keys + teacher_logits.COLUMNS
      self.roles = (roles.policy(self.loss),)
    else:
      self.roles = (roles.policy(self.loss), roles.teacher(config, f"posttrain_mode={self.name}"))
    self.layers = self._with_layer_transfer() if layer_transfer.enabled(config) else None

  def _with_layer_transfer(self) -> layer_transfer.LayerMap:
    """Both models built to expose their layers (attention probabilities, and the out-projection activations that
    MaxText sows when the model's config has distill_beta > 0, which the teacher's gets from the run's); returns the
    matched layers."""
    config = self.config
    capture = functools.partial(
        layer_capture.enable_capture,
        attention=self.section.attention_weight > 0,
        hidden=config.distill_beta > 0 and self.section.feature_source == "hidden",
    )
    policy, teacher = self.roles
    overrides = {"distill_beta": config.distill_beta} | dict(teacher.overrides)
    teacher = dataclasses.replace(teacher, overrides=overrides, prepare=capture)
    teacher_config = roles.role_config(config, teacher)
    prepare_student = capture
    width = teacher_config.emb_dim
    if config.distill_beta > 0 and self.section.feature_projection == "linear" and width != config.emb_dim:
      if lora.enabled(config):
        raise config_lib.ConfigError(
            "distill.feature_projection=linear trains a map beside the student's weights, which LoRA keeps frozen: "
            "use distill.feature_projection=pool, or train the student fully."
        )

      def prepare_student(model):
        return layer_transfer.attach_projection(capture(model), config, width)

    self.roles = (dataclasses.replace(policy, prepare=prepare_student), teacher)
    return layer_transfer.layer_map(config, teacher_config)

  def make_data(self, mesh) -> ObjectiveData:
    if not self.offline:
      return super().make_data(mesh)
    join = functools.partial(teacher_logits.with_teacher, self.config)
    train, evaluation, stats = pipeline.make_sft_iterators(self.config, mesh, join, teacher_logits.COLUMNS)
    return ObjectiveData(train=train, eval=evaluation, description=stats.to_dict())

  def batch_spec(self, train: bool = True) -> dict[str, jax.ShapeDtypeStruct] | None:
    """SFT's batch, the schedules' [rows, 1] float32 columns and, from teacher files, the teacher's top-k columns."""
    spec = super().batch_spec(train)
    if spec is None:
      return None
    rows, length = spec["inputs"].shape
    schedules = (ALPHA_KEY, TEMPERATURE_KEY, layer_transfer.BETA_KEY)
    spec |= {key: jax.ShapeDtypeStruct((rows, 1), jnp.float32) for key in schedules}
    if self.offline:
      ids, logprobs, log_rest = teacher_logits.COLUMNS
      k = self.section.top_k
      spec[ids] = jax.ShapeDtypeStruct((rows, length, k), jnp.int32)
      spec[logprobs] = jax.ShapeDtypeStruct((rows, length, k), jnp.float32)
      spec[log_rest] = jax.ShapeDtypeStruct((rows, length), jnp.float32)
    return spec

  def _with_schedules(self, loop, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """`batch` plus the schedules' values at this step as [rows, 1] columns, sharded as the batch's tokens are (the
    steps' data shardings are for [rows, length] arrays)."""
    rows, sharding = batch["inputs"].shape[0], batch["inputs"].sharding
    scheduled = {}
    for key, value in schedule_values(self.config, loop.step).items():
      column = np.full((rows, 1), value, np.float32)
      scheduled[key] = jax.make_array_from_callback(column.shape, sharding, lambda index, column=column: column[index])
    return batch | scheduled

  def before_step(self, loop, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return self._with_schedules(loop, batch)

  def before_eval_step(self, loop, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return self._with_schedules(loop, batch)

  def loss(self, model, batch: dict[str, jax.Array], is_train: bool, frozen=None) -> LossOutput:
    inputs = (batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
    dropout = self.config.enable_dropout and is_train
    # The data pipeline zeroes targets_segmentation on prompt tokens (completion-only SFT) and on padding.
    mask = batch["targets_segmentation"] != 0
    transfer = {}
    if self.layers is not None:
      student_logits, student_layers = layer_capture.forward_with_captures(model, *inputs, enable_dropout=dropout)
      teacher_scores, teacher_layers = layer_capture.forward_with_captures(frozen[roles.TEACHER], *inputs)
      transfer = layer_transfer.transfer_losses(self.config, self.layers, model, student_layers, teacher_layers, mask)
    else:
      student_logits = forward.logits(model, *inputs, enable_dropout=dropout)
      teacher_scores = None if self.offline else forward.logits(frozen[roles.TEACHER], *inputs)
    hard_total, weight, z_total = cross_entropy.token_cross_entropy(
        student_logits, batch["targets"], mask, z_loss=self.config.z_loss_multiplier
    )
    alpha, temperature = jnp.mean(batch[ALPHA_KEY]), jnp.mean(batch[TEMPERATURE_KEY])
    if self.offline:
      teacher = tuple(batch[key] for key in teacher_logits.COLUMNS)
      soft = distillation.sparse_logit_loss(
          student_logits, *teacher, mask, self.section.divergence, temperature, self.section.jsd_beta
      )
    else:
      soft = soft_loss(self.section, student_logits, teacher_scores, mask, temperature)
    total = alpha * soft.total + (1.0 - alpha) * hard_total
    weights = {"feature": jnp.mean(batch[layer_transfer.BETA_KEY]), "attention": self.section.attention_weight}
    for name, term in transfer.items():
      total += weights[name] * term.total
    metrics = {
        "ce": hard_total - z_total,
        "z_loss": z_total,
        "soft_loss": soft.total,
        **soft.metrics,
        ALPHA_KEY: alpha * weight,
        TEMPERATURE_KEY: temperature * weight,
        **{f"{name}_loss": term.total for name, term in transfer.items()},
    }
    return LossOutput(total=total, weight=weight, metrics={k: jax.lax.stop_gradient(v) for k, v in metrics.items()})

  def headline_metrics(self, scalars: dict[str, Any]) -> dict[str, float]:
    """The student's cross entropy on the labels, its divergence from the teacher, how often their most likely
    tokens agree, and the layer-transfer terms that are part of the loss (feature, attention)."""
    figures = {
        "ce": float(scalars["learning/ce"]),
        "divergence": float(scalars["learning/divergence"]),
        "agreement": float(scalars["learning/top1_agreement"]),
    }
    return figures | {name: float(scalars[f"learning/{name}"]) for name in _TRANSFER if f"learning/{name}" in scalars}

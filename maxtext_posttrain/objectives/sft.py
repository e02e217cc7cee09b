"""Supervised fine-tuning: next-token cross entropy on completion tokens (or all tokens), packed or padded."""

import math
from typing import Any

import jax

from maxtext.utils import maxtext_utils
from maxtext_posttrain import forward
from maxtext_posttrain.data import pipeline
from maxtext_posttrain.losses import cross_entropy
from maxtext_posttrain.objectives.base import LossOutput, Objective, ObjectiveData, register
from maxtext_posttrain import generation_eval


@register
class SFT(Objective):
  """`posttrain_mode=sft`: MaxText's SFT data conventions (`sft_train_on_completion_only`, `packing`)."""

  name = "sft"
  batch_keys = pipeline.SFT_KEYS

  def make_data(self, mesh) -> ObjectiveData:
    train, evaluation, stats = pipeline.make_sft_iterators(self.config, mesh)
    return ObjectiveData(train=train, eval=evaluation, description=stats.to_dict())

  def batch_spec(self, train: bool = True) -> dict[str, jax.ShapeDtypeStruct] | None:
    """MaxText's SFT batch (`get_shaped_batch`: six [rows, max_target_length] int32 arrays); held-out batches when
    `eval_interval` > 0."""
    if not train and self.config.eval_interval <= 0:
      return None
    shaped = maxtext_utils.get_shaped_batch(self.config, is_eval=not train)
    return {key: shaped[key] for key in pipeline.SFT_KEYS}

  def loss(self, model, batch: dict[str, jax.Array], is_train: bool, frozen=None) -> LossOutput:
    del frozen
    logits = forward.logits(
        model,
        batch["inputs"],
        batch["inputs_position"],
        batch["inputs_segmentation"],
        enable_dropout=self.config.enable_dropout and is_train,
    )
    # The data pipeline zeroes targets_segmentation on prompt tokens (completion-only SFT) and on padding.
    total, weight, z_total = cross_entropy.token_cross_entropy(
        logits, batch["targets"], batch["targets_segmentation"] != 0, z_loss=self.config.z_loss_multiplier
    )
    return LossOutput(total=total, weight=weight, metrics={"z_loss": z_total})

  def headline_metrics(self, scalars: dict[str, Any]) -> dict[str, float]:
    """Perplexity of the trained tokens: exp of the mean token cross entropy (the loss without its z-loss term)."""
    cross_entropy_mean = float(scalars["learning/loss"]) - float(scalars.get("learning/z_loss", 0.0))
    return {"perplexity": math.exp(min(cross_entropy_mean, 700.0))}

  def evaluate(self, loop) -> dict[str, float]:
    if self.config.eval_generation_examples <= 0:
      return {}
    return generation_eval.greedy_answer_accuracy(loop, self.config.eval_generation_examples)

"""Reward-model training: a MaxText decoder with a scalar head, fit to preference pairs by Bradley-Terry.

`posttrain_mode=reward_model` reads the (prompt, chosen, rejected) pairs DPO reads (the bundled arithmetic pairs,
JSONL, TFDS), with an optional fourth column, a per-pair margin. The trained role is the reward model itself (the
primary role: its checkpoints are `<run>/checkpoints`, so RL reads it with `reward_model_overrides.load_parameters_path`
and PPO's critic can start from it); it starts from `load_parameters_path` (an SFT model's decoder, with a fresh
head) or the seeded init. The score of a completion is the head's output at its last token; the loss is
-log sigmoid(r_chosen - r_rejected - margin) plus `reward_model.center_rewards_coefficient` x (r_chosen + r_rejected)^2
(TRL's RewardTrainer). Held-out pair accuracy and margin come from the eval loss pass (`eval/accuracy`, `eval/margin`).
Chosen and rejected are scored in one forward, interleaved as DPO interleaves them.
"""

from typing import Any

import jax
import jax.numpy as jnp

from maxtext_posttrain import config as config_lib
from maxtext_posttrain import forward
from maxtext_posttrain import roles
from maxtext_posttrain.data import preference as preference_data
from maxtext_posttrain.losses import reward_model as reward_model_losses
from maxtext_posttrain.objectives.dpo import Preference, check_config, interleave
from maxtext_posttrain.objectives.base import LossOutput, Objective, ObjectiveData, register, rows_spec

ROLE = "reward_model"


def pair_rewards(model, batch: dict[str, jax.Array], enable_dropout: bool = False) -> tuple[jax.Array, jax.Array]:
  """([B] chosen rewards, [B] rejected rewards): the scalar head at each side's last token, from one forward."""
  segmentation = interleave(batch, "segmentation")
  values = forward.scalars(
      model, interleave(batch, "inputs"), interleave(batch, "positions"), segmentation, enable_dropout
  )
  last = jnp.maximum(jnp.sum(segmentation != 0, axis=-1) - 1, 0)
  rewards = jnp.take_along_axis(values, last[:, None], axis=-1)[:, 0].reshape(-1, 2)
  return rewards[:, 0], rewards[:, 1]


@register
class RewardModel(Objective):
  """`posttrain_mode=reward_model`: Bradley-Terry on preference pairs."""

  name = "reward_model"
  example_unit = "pairs"
  batch_keys = Preference.batch_keys

  def __init__(self, config):
    super().__init__(config)
    check_config(config)
    self.section = config_lib.reward_model(config)
    self.roles = (roles.RoleSpec(ROLE, trained=True, head="scalar", loss=self.loss),)

  def make_data(self, mesh) -> ObjectiveData:
    train = preference_data.prepare_pairs(self.config, train=True)
    train_iterator, eval_iterator, stats = preference_data.make_preference_iterators(self.config, mesh, train=train)
    return ObjectiveData(train=train_iterator, eval=eval_iterator, description=stats.to_dict())

  def batch_spec(self, train: bool = True) -> dict[str, jax.ShapeDtypeStruct] | None:
    """DPO's pair arrays without reference log-probs, and the [pairs] float32 margin when the data has a fourth
    column."""
    config = self.config
    if not train and config.eval_interval <= 0:
      return None
    pairs = config.global_batch_size_to_load if train else config.global_batch_size_to_load_eval
    spec = rows_spec(pairs, config.max_target_length, self.batch_keys)
    columns = config.train_data_columns if train else config.eval_data_columns
    if len(columns) == len(preference_data.COLUMNS) + 1:
      spec[preference_data.MARGIN] = jax.ShapeDtypeStruct((pairs,), jnp.float32)
    return spec

  def loss(self, model, batch: dict[str, jax.Array], is_train: bool, frozen=None) -> LossOutput:
    del frozen
    chosen, rejected = pair_rewards(model, batch, self.config.enable_dropout and is_train)
    valid = jnp.all(jnp.stack([batch[f"{side}_weights"].sum(-1) > 0 for side in preference_data.SIDES]), axis=0)
    out = reward_model_losses.bradley_terry(
        chosen,
        rejected,
        margin=batch.get(preference_data.MARGIN),
        centering_coef=self.section.center_rewards_coefficient,
        valid=valid,
    )
    return LossOutput(out.total, out.weight, {k: jax.lax.stop_gradient(v) for k, v in out.metrics.items()})

  def headline_metrics(self, scalars: dict[str, Any]) -> dict[str, float]:
    """How often, and by how much, the reward model prefers the chosen side on the training batch."""
    return {"accuracy": float(scalars["learning/accuracy"]), "margin": float(scalars["learning/margin"])}

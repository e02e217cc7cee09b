"""The Bradley-Terry loss of reward-model training over scalar rewards of preference pairs.

A reward model scores the chosen and the rejected completion of each pair with one scalar each; the loss asks the
chosen one to win under the Bradley-Terry model P(chosen > rejected) = sigmoid(r_c - r_r) (Ouyang et al. 2022,
section 3.5; TRL's RewardTrainer). As the policy losses, it comes back as a numerator and its weight (the number of
real pairs) so that gradient-accumulation microbatches, padding pairs included, add up to the whole batch.
"""

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RewardModelLoss:
  """An aggregated loss: the loss is total / weight.

  Attributes:
    total: sum of the per-pair losses over valid pairs.
    weight: the number of valid pairs.
    metrics: numerators over the same weight, so each metric is metrics[k] / weight and microbatch numerators add up:
      "accuracy" (pairs whose chosen reward is the higher; a tie counts half, as the DPO objective's accuracy),
      "margin" (r_c - r_r, without the margin argument), "chosen" and "rejected" (the rewards).
  """

  total: jax.Array
  weight: jax.Array
  metrics: dict[str, jax.Array]


def bradley_terry(
    chosen_rewards: jax.Array,
    rejected_rewards: jax.Array,
    margin: jax.Array | None = None,
    centering_coef: float = 0.0,
    valid: jax.Array | None = None,
) -> RewardModelLoss:
  """Per pair, loss_i = -log sigmoid(r_c - r_r - margin_i) + centering_coef * (r_c + r_r)^2, summed over valid pairs.

  The margin (Llama 2's, Touvron et al. 2023, section 3.2.2) asks for a larger gap where annotators preferred the
  chosen completion more strongly. The centering term (Eisenstein et al. 2023; TRL's `center_rewards_coefficient`)
  pulls the rewards towards mean 0: Bradley-Terry only sees differences, so their offset would otherwise drift.

  Args:
    chosen_rewards: [B] scalar rewards of the chosen completions (differentiated).
    rejected_rewards: [B] those of the rejected completions (differentiated).
    margin: [B] per-pair margins, or None for 0 (not differentiated).
    centering_coef: weight of the centering term; 0 for none.
    valid: [B] bool, False on padding pairs, whose entries are ignored even if not finite; None: all pairs count.

  Returns:
    A RewardModelLoss; the loss is total / weight.
  """
  chosen_rewards, rejected_rewards = jnp.asarray(chosen_rewards), jnp.asarray(rejected_rewards)
  if chosen_rewards.ndim != 1 or rejected_rewards.shape != chosen_rewards.shape:
    raise ValueError(f"chosen_rewards {chosen_rewards.shape} and rejected_rewards {rejected_rewards.shape} must be [B].")
  for name, x in (("margin", margin), ("valid", valid)):
    if x is not None and jnp.shape(x) != chosen_rewards.shape:
      raise ValueError(f"{name} {jnp.shape(x)} must match the rewards {chosen_rewards.shape}.")
  valid = jnp.ones(chosen_rewards.shape, bool) if valid is None else jnp.asarray(valid) != 0

  def masked(x):
    return jnp.where(valid, jnp.asarray(x).astype(jnp.float32), 0.0)

  chosen, rejected = masked(chosen_rewards), masked(rejected_rewards)
  margin = 0.0 if margin is None else jax.lax.stop_gradient(masked(margin))
  difference = chosen - rejected
  losses = -jax.nn.log_sigmoid(difference - margin) + centering_coef * jnp.square(chosen + rejected)
  accuracy = (difference > 0).astype(jnp.float32) + 0.5 * (difference == 0).astype(jnp.float32)

  def total(x):
    return jnp.sum(jnp.where(valid, x, 0.0))

  metrics = {"accuracy": total(accuracy), "margin": total(difference), "chosen": total(chosen)}
  metrics["rejected"] = total(rejected)
  return RewardModelLoss(total=total(losses), weight=jnp.sum(valid).astype(jnp.float32), metrics=metrics)

"""Group-relative advantages for the GRPO family: each prompt's sampled completions are one another's baseline.

Critic-free RL for language models (GRPO, Dr.GRPO, RLOO, DAPO) samples G completions per prompt and scores each
against the rewards of its own group instead of a learned value function. Rewards therefore arrive prompt-major:
the G samples of prompt p are rows p*G .. p*G+G-1.
"""

import jax
import jax.numpy as jnp

ESTIMATORS = ("grpo", "rloo")


def _groups(rewards: jax.Array, group_size: int) -> jax.Array:
  """[N] rewards -> [N / group_size, group_size] float32, one row per prompt."""
  rewards = jnp.asarray(rewards)
  if rewards.ndim != 1 or group_size < 1 or rewards.shape[0] % group_size:
    raise ValueError(
        f"rewards of shape {rewards.shape} do not split into groups of group_size={group_size}; expected [N] with N a"
        " multiple of group_size >= 1."
    )
  return rewards.astype(jnp.float32).reshape(-1, group_size)


def group_advantages(
    rewards: jax.Array, group_size: int, *, estimator: str = "grpo", scale_by_std: bool = True, epsilon: float = 1e-4
) -> jax.Array:
  """Per-completion advantages from the rewards of each prompt's group.

  With r the G rewards of one group, mean(r) their mean and std(r) their population standard deviation (ddof=0):
    grpo:  A_i = (r_i - mean(r)) / (std(r) + epsilon)   (DeepSeekMath, Shao et al. 2024, outcome supervision)
           A_i = r_i - mean(r)   when not scale_by_std   (Dr.GRPO, Liu et al. 2025: the std divisor biases
           the update towards groups that are nearly all right or all wrong)
    rloo:  A_i = r_i - 1/(G-1) sum_{j != i} r_j = G/(G-1) (r_i - mean(r))   (RLOO, Ahmadian et al. 2024);
           scale_by_std and epsilon are ignored.

  Args:
    rewards: [N] scalar rewards, N = num_prompts * group_size, prompt-major.
    group_size: G, the completions sampled per prompt (>= 2 for rloo).
    estimator: one of ESTIMATORS.
    scale_by_std: grpo only; divide by the group's std.
    epsilon: grpo only; added to the std so zero-variance groups get advantage 0 rather than 0/0.

  Returns:
    [N] float32 advantages, in the order of `rewards`.
  """
  if estimator not in ESTIMATORS:
    raise ValueError(f"Unknown advantage estimator {estimator!r}; expected one of {ESTIMATORS}.")
  if estimator == "rloo" and group_size < 2:
    raise ValueError(f"rloo needs group_size >= 2 (a leave-one-out baseline), got group_size={group_size}.")
  groups = _groups(rewards, group_size)
  centred = groups - jnp.mean(groups, axis=1, keepdims=True)
  if estimator == "rloo":
    return (centred * (group_size / (group_size - 1))).reshape(-1)
  if scale_by_std:
    centred = centred / (jnp.std(groups, axis=1, keepdims=True) + epsilon)
  return centred.reshape(-1)


def zero_variance_groups(rewards: jax.Array, group_size: int) -> jax.Array:
  """[num_prompts] bool: True where all G rewards of the prompt are equal, so every advantage is 0.

  Such groups give no policy gradient; DAPO's dynamic sampling (Yu et al. 2025) drops them from the batch.
  """
  groups = _groups(rewards, group_size)
  return jnp.all(groups == groups[:, :1], axis=1)

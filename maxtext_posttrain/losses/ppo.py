"""PPO with a learned critic (Ziegler et al. 2019; Ouyang et al. 2022): KL-shaped token rewards, GAE, the clipped
value loss, and the adaptive KL coefficient.

The critic-free GRPO family scores a completion against its own group (`advantages.group_advantages`); PPO instead
learns a value V_t for every completion token and turns one sequence score into per-token advantages through
generalised advantage estimation. The policy side reuses `policy_gradient.policy_loss` (algo "grpo" with [N, T]
advantages is PPO's clipped surrogate); this module holds what the critic adds. Everything is a pure function over
[N, T] arrays whose `mask` marks the completion tokens, so that each formula can be checked against a numpy loop.
Entries outside the mask are ignored, even if not finite, and come back as 0.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

from maxtext_posttrain.losses import policy_gradient


def _check_shapes(mask: jax.Array, **arrays: jax.Array) -> None:
  mask = jnp.asarray(mask)
  if mask.ndim != 2 or any(jnp.shape(x) != mask.shape for x in arrays.values()):
    shapes = ", ".join(f"{name} {jnp.shape(x)}" for name, x in arrays.items())
    raise ValueError(f"{shapes} and mask {mask.shape} must all be [N, T].")


def _masked(values: jax.Array, mask: jax.Array) -> jax.Array:
  """float32 values, 0 outside the mask (a `where`, not a product, so that inf or nan there cannot leak in)."""
  return jnp.where(mask, jnp.asarray(values).astype(jnp.float32), 0.0)


def kl_shaped_rewards(
    scores: jax.Array,
    logps: jax.Array,
    ref_logps: jax.Array,
    mask: jax.Array,
    kl_coef: float | jax.Array,
    kl_estimator: str = "k1",
) -> tuple[jax.Array, jax.Array]:
  """Per-token rewards of PPO-RLHF: a KL penalty on every completion token, the sequence's score on its last one.

  r_t = -kl_coef * kl_t + [t is the row's last completion token] * score, with kl_t =
  `policy_gradient.kl_penalty(logps, ref_logps, kl_estimator)`. The penalty sits in the reward rather than in the loss
  (as GRPO's beta does) so that GAE credits it, discounted, to the tokens before it. "Last" is the last nonzero of
  the row's mask; a row with an empty mask gets no score. Rewards are data to the critic and the policy alike, so
  no gradient flows through them (nor through the returned KL, which is for logging and for
  `AdaptiveKLController.update`).

  Args:
    scores: [N] sequence scores, e.g. of a reward model.
    logps: [N, T] log-probs of the sampled tokens under the policy that sampled them.
    ref_logps: [N, T] log-probs under the frozen reference policy.
    mask: [N, T], nonzero on completion tokens.
    kl_coef: the KL coefficient, e.g. an `AdaptiveKLController`'s value; passed traced, a changing coefficient does
      not recompile a jitted caller.
    kl_estimator: one of `policy_gradient.KL_ESTIMATORS`; k1, the log-ratio, is Ziegler et al.'s and TRL's default.

  Returns:
    (rewards, kl), [N, T] float32 each, 0 outside the mask.
  """
  _check_shapes(mask, logps=logps, ref_logps=ref_logps)
  if jnp.shape(scores) != jnp.shape(mask)[:1]:
    raise ValueError(f"scores {jnp.shape(scores)} must be [N] for mask {jnp.shape(mask)}.")
  mask = jnp.asarray(mask) != 0
  logps, ref_logps = (jax.lax.stop_gradient(_masked(x, mask)) for x in (logps, ref_logps))
  kl = jnp.where(mask, policy_gradient.kl_penalty(logps, ref_logps, kl_estimator), 0.0)
  positions = jnp.arange(mask.shape[1])
  last = jnp.max(jnp.where(mask, positions, -1), axis=1, keepdims=True)  # -1 on an empty row: matches no position
  scores = jax.lax.stop_gradient(jnp.asarray(scores).astype(jnp.float32))
  rewards = -jax.lax.stop_gradient(jnp.asarray(kl_coef, jnp.float32)) * kl
  rewards = rewards + jnp.where(positions[None, :] == last, scores[:, None], 0.0)
  return rewards, kl


def gae(
    rewards: jax.Array, values: jax.Array, mask: jax.Array, gamma: float = 1.0, lam: float = 0.95
) -> tuple[jax.Array, jax.Array]:
  """Generalised advantage estimation (Schulman et al. 2016) over each row's completion tokens.

  Backwards over the completion tokens of a row, with the value after its last one 0 (the episode ends there):
    delta_t = r_t + gamma V_{t+1} - V_t
    A_t = delta_t + gamma lam A_{t+1}
    returns_t = A_t + V_t   (the critic's regression target; a lam-return)
  Completion tokens may start at any column (left-padded prompts). V_{t+1} and A_{t+1} are those of the next
  completion token of the row, so positions outside the mask are skipped rather than treated as episode ends: for a
  contiguous completion this is the same, and a hole (say, tool output spliced into a multi-turn completion) is
  stepped over as verl's compute_gae_advantage_return does ("skip values and TD-error on observation tokens").
  Advantages and returns are targets, so no gradient flows into rewards or values.

  Args:
    rewards: [N, T] per-token rewards, e.g. of `kl_shaped_rewards`.
    values: [N, T] the critic's values V_t of the state before each token is chosen.
    mask: [N, T], nonzero on completion tokens.
    gamma: discount factor.
    lam: GAE's lambda: 0 gives one-step TD errors (low variance, biased by V), 1 gives Monte-Carlo returns minus V.

  Returns:
    (advantages, returns), [N, T] float32 each, 0 outside the mask.
  """
  _check_shapes(mask, rewards=rewards, values=values)
  mask = jnp.asarray(mask) != 0
  rewards, values = (jax.lax.stop_gradient(_masked(x, mask)) for x in (rewards, values))

  def step(carry, xs):
    next_value, next_advantage = carry
    reward, value, token = xs
    advantage = reward + gamma * next_value - value + gamma * lam * next_advantage
    carry = (jnp.where(token, value, next_value), jnp.where(token, advantage, next_advantage))
    return carry, jnp.where(token, advantage, 0.0)

  zeros = jnp.zeros(mask.shape[:1], jnp.float32)
  _, advantages = jax.lax.scan(step, (zeros, zeros), (rewards.T, values.T, mask.T), reverse=True)
  advantages = advantages.T
  return advantages, jnp.where(mask, advantages + values, 0.0)


def _masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
  return jnp.sum(jnp.where(mask, values, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


def whiten(values: jax.Array, mask: jax.Array, shift_mean: bool = True, eps: float = 1e-8) -> jax.Array:
  """(x - mean) / sqrt(var + eps) over the masked entries of the whole batch, as TRL's and verl's masked_whiten.

  The variance is the unbiased one (Bessel's correction, n / (n - 1)), as theirs, so that whitened advantages match
  those of the implementations PPO recipes were tuned with; with a single masked entry it is taken as 0 rather than
  0/0, and the result is 0. With shift_mean False the mean is added back, so only the scale changes (TRL whitens
  rewards that way).

  Args:
    values: [N, T] values, e.g. advantages of `gae`.
    mask: [N, T], nonzero on the entries to whiten.
    shift_mean: subtract the mean (True) or keep it (False).
    eps: added to the variance so constant values do not divide by 0.

  Returns:
    [N, T] float32, 0 outside the mask.
  """
  _check_shapes(mask, values=values)
  mask = jnp.asarray(mask) != 0
  values = _masked(values, mask)
  count = jnp.sum(mask).astype(jnp.float32)
  mean = _masked_mean(values, mask)
  var = _masked_mean(jnp.square(values - mean), mask) * count / jnp.maximum(count - 1.0, 1.0)
  whitened = (values - mean) * jax.lax.rsqrt(var + eps)
  if not shift_mean:
    whitened = whitened + mean
  return jnp.where(mask, whitened, 0.0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ValueLoss:
  """An aggregated value loss, as `policy_gradient.aggregate` returns it: the loss is total / weight.

  Attributes:
    total: numerator of the loss.
    weight: its denominator (tokens or sequences, by aggregation mode).
    metrics: numerators over the same weight, so each metric is metrics[k] / weight and microbatch numerators add up:
      "vf_clip_fraction", the fraction of tokens whose clipped term is strictly the larger (the active one), averaged
      per token under token-mean and per sequence under the seq-mean modes (whose weight, the sequence count,
      seq-mean-token-mean shares), so it stays a mean whatever the loss's normaliser, as `PolicyLoss`'s fractions.
  """

  total: jax.Array
  weight: jax.Array
  metrics: dict[str, jax.Array]


def value_loss(
    values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    mask: jax.Array,
    clip_range: float | None,
    agg_mode: str = "token-mean",
    max_length: int | None = None,
) -> ValueLoss:
  """PPO's clipped value loss: the critic regresses on the returns, kept near the values the returns came from.

  Per token, with v_clipped = old + clip(values - old, -clip_range, clip_range):
    loss_t = 0.5 * max((values - returns)^2, (v_clipped - returns)^2)
  (the pessimistic max, as in OpenAI's baselines, TRL and verl), aggregated with `policy_gradient.aggregate`. With
  clip_range None or <= 0, loss_t = 0.5 * (values - returns)^2.

  Args:
    values: [N, T] the critic's current values (differentiated).
    old_values: [N, T] its values when the rollout was scored, from which the returns were computed (not
      differentiated).
    returns: [N, T] regression targets, e.g. of `gae` (not differentiated).
    mask: [N, T], nonzero on completion tokens.
    clip_range: how far values may move from old_values before the clipped term takes over; None or <= 0: no clip.
    agg_mode: one of `policy_gradient.AGG_MODES`.
    max_length: the normaliser of seq-mean-token-sum-norm (T if None).

  Returns:
    A ValueLoss; the loss is total / weight.
  """
  _check_shapes(mask, values=values, old_values=old_values, returns=returns)
  if agg_mode not in policy_gradient.AGG_MODES:
    raise ValueError(f"Unknown agg_mode {agg_mode!r}; expected one of {policy_gradient.AGG_MODES}.")
  mask = jnp.asarray(mask) != 0
  values = _masked(values, mask)
  old_values, returns = (jax.lax.stop_gradient(_masked(x, mask)) for x in (old_values, returns))
  unclipped = jnp.square(values - returns)
  if clip_range is None or clip_range <= 0:
    loss, clipped = 0.5 * unclipped, jnp.zeros(mask.shape, bool)
  else:
    v_clipped = old_values + jnp.clip(values - old_values, -clip_range, clip_range)
    clipped_error = jnp.square(v_clipped - returns)
    loss, clipped = 0.5 * jnp.maximum(unclipped, clipped_error), clipped_error > unclipped
  total, weight = policy_gradient.aggregate(loss, mask, agg_mode, max_length)
  mean_mode = "token-mean" if agg_mode == "token-mean" else "seq-mean-token-mean"
  metrics = {"vf_clip_fraction": policy_gradient.aggregate(clipped, mask, mean_mode)[0]}
  return ValueLoss(total=total, weight=weight, metrics=metrics)


def explained_variance(values: jax.Array, returns: jax.Array, mask: jax.Array) -> jax.Array:
  """1 - Var[returns - values] / Var[returns] over the masked entries: how much of the returns the critic predicts.

  1 for a perfect critic, 0 for one that predicts the mean, negative for one worse than that. Where the returns do
  not vary (or the mask is empty) the ratio is 0/0; this returns 0.0 there, where TRL returns nan, so that a logged
  mean over steps stays finite. Both variances are population variances (Bessel's factor would cancel).

  Args:
    values: [N, T] the critic's values.
    returns: [N, T] its targets.
    mask: [N, T], nonzero on the entries to compare.

  Returns:
    A float32 scalar.
  """
  _check_shapes(mask, values=values, returns=returns)
  mask = jnp.asarray(mask) != 0
  values, returns = _masked(values, mask), _masked(returns, mask)

  def variance(x):
    return _masked_mean(jnp.square(x - _masked_mean(x, mask)), mask)

  var_returns = variance(returns)
  ratio = variance(returns - values) / jnp.where(var_returns > 0, var_returns, 1.0)
  return jnp.where(var_returns > 0, 1.0 - ratio, 0.0)


class AdaptiveKLController:
  """The KL coefficient of Ziegler et al. 2019, as TRL's AdaptiveKLController: steered towards a target.

  After each batch, with e = clip(current_kl / target - 1, -0.2, 0.2), value *= 1 + e * n_steps / horizon: a KL above
  target raises the penalty, one below lowers it, by at most 20% per horizon steps. It lives on the host (the
  coefficient is a Python float handed to `kl_shaped_rewards` each step); `state_dict` and `load_state_dict` carry
  it through checkpoints. A fixed coefficient is `FixedKLController`, which has the same interface.

  Attributes:
    value: the current KL coefficient.
    target: the KL the coefficient steers towards, measured as update's current_kl is (Ziegler et al. and TRL use
      the KL of a sequence, summed over its tokens, averaged over the batch).
    horizon: the number of steps (samples, in TRL) over which the 20% adjustment accrues.
  """

  def __init__(self, init_kl_coef: float, target: float, horizon: float):
    if not init_kl_coef >= 0 or not target > 0 or not horizon > 0:
      raise ValueError(f"need init_kl_coef >= 0, target > 0, horizon > 0; got {init_kl_coef}, {target}, {horizon}.")
    self.value = float(init_kl_coef)
    self.target = float(target)
    self.horizon = float(horizon)

  def update(self, current_kl: float, n_steps: int) -> float:
    """Moves the coefficient after a batch of n_steps whose measured KL was current_kl; returns the new value.

    A non-finite KL raises rather than turning the coefficient into nan for the rest of the run.
    """
    current_kl = float(current_kl)
    if not math.isfinite(current_kl):
      raise ValueError(f"current_kl must be finite, got {current_kl}.")
    proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
    self.value *= 1.0 + proportional_error * n_steps / self.horizon
    return self.value

  def state_dict(self) -> dict[str, float]:
    """The state that changes during training (the coefficient); target and horizon come from the config."""
    return {"value": self.value}

  def load_state_dict(self, state: dict[str, float]) -> None:
    self.value = float(state["value"])


class FixedKLController:
  """A constant KL coefficient, with `AdaptiveKLController`'s interface so the trainer handles both alike."""

  def __init__(self, kl_coef: float):
    if not kl_coef >= 0:
      raise ValueError(f"kl_coef must be >= 0, got {kl_coef}.")
    self.value = float(kl_coef)

  def update(self, current_kl: float, n_steps: int) -> float:  # pylint: disable=unused-argument
    """Leaves the coefficient as it is; returns it."""
    return self.value

  def state_dict(self) -> dict[str, float]:
    return {"value": self.value}

  def load_state_dict(self, state: dict[str, float]) -> None:
    self.value = float(state["value"])

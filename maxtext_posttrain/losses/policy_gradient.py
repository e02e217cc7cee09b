"""Clipped policy-gradient losses of the GRPO family (GRPO, Dr.GRPO, DAPO, GSPO) over per-token log-probs.

Losses come back as a numerator and its weight rather than a mean: the trainer sums both over gradient-accumulation
microbatches and divides once, so the loss of a batch does not depend on how it is split (a mean of microbatch
means would weigh microbatches equally, whatever their token or sequence counts). Log-probs are those of
`logprobs.token_logprobs`, advantages those of `advantages.group_advantages`.
"""

import dataclasses

import jax
import jax.numpy as jnp

ALGOS = ("grpo", "gspo", "gspo_token")
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")


def _check_option(name: str, value: str, options: tuple[str, ...]) -> None:
  if value not in options:
    raise ValueError(f"Unknown {name} {value!r}; expected one of {options}.")


def aggregate(
    values: jax.Array, mask: jax.Array, mode: str, max_length: int | None = None
) -> tuple[jax.Array, jax.Array]:
  """Reduces per-token values to (total, weight), the aggregated value being total / weight.

  Both are sums over sequences, so the totals and weights of microbatches add up to those of the whole batch (the
  normaliser max_length is a constant, so this holds in every mode). The modes are verl's agg_loss modes;
  `config.AGG_MODE_ALIASES` maps Tunix's spellings onto them. With m the mask, n_i = sum_t m_it and S the number of
  sequences with n_i > 0:
    token-mean:               sum_it m v / sum_it m          (DAPO's token-level loss: every token weighs the same)
    seq-mean-token-mean:      sum_i (sum_t m v / n_i) / S    (GRPO's 1/G sum_i 1/|o_i| sum_t: every sequence does)
    seq-mean-token-sum:       sum_it m v / S                 (also Tunix's sequence-mean-token-sum-norm)
    seq-mean-token-sum-norm:  sum_it m v / (max_length S)    (Dr.GRPO: a constant in place of 1/|o_i|; Tunix's
                                                              sequence-mean-token-scale)

  Args:
    values: [N, T] per-token values; entries outside the mask are ignored, even if not finite.
    mask: [N, T], nonzero on the tokens to aggregate.
    mode: one of AGG_MODES.
    max_length: the normaliser of seq-mean-token-sum-norm, the maximum completion length (T if None).

  Returns:
    (total, weight), float32 scalars.
  """
  _check_option("agg_mode", mode, AGG_MODES)
  if values.ndim != 2 or values.shape != mask.shape:
    raise ValueError(f"values {values.shape} and mask {mask.shape} must both be [N, T].")
  mask = jnp.asarray(mask) != 0
  masked = jnp.where(mask, values.astype(jnp.float32), 0.0)
  tokens = jnp.sum(mask, axis=1).astype(jnp.float32)
  if mode == "token-mean":
    return jnp.sum(masked), jnp.sum(tokens)
  sequences = jnp.sum(tokens > 0).astype(jnp.float32)
  if mode == "seq-mean-token-mean":
    return jnp.sum(jnp.sum(masked, axis=1) / jnp.maximum(tokens, 1.0)), sequences
  if mode == "seq-mean-token-sum":
    return jnp.sum(masked), sequences
  return jnp.sum(masked) / (values.shape[1] if max_length is None else max_length), sequences


def kl_penalty(logps: jax.Array, ref_logps: jax.Array, estimator: str) -> jax.Array:
  """Per-token estimate of KL(pi || pi_ref) at tokens sampled from pi (Schulman 2020, "Approximating KL Divergence").

  With d = logps - ref_logps = log(pi / pi_ref):
    k1 = d                    (unbiased, can be negative)
    k2 = d^2 / 2              (biased, low variance)
    k3 = exp(-d) + d - 1      (unbiased and >= 0; the estimator of DeepSeekMath's GRPO objective)
  """
  _check_option("kl_estimator", estimator, KL_ESTIMATORS)
  d = logps.astype(jnp.float32) - ref_logps.astype(jnp.float32)
  if estimator == "k1":
    return d
  if estimator == "k2":
    return 0.5 * jnp.square(d)
  return jnp.exp(-d) + d - 1.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PolicyLoss:
  """An aggregated loss, as `aggregate` returns it: the loss is total / weight.

  Attributes:
    total: numerator of the loss, policy-gradient term plus beta * KL.
    weight: its denominator (tokens or sequences, by aggregation mode).
    metrics: numerators over the same weight, so each metric is metrics[k] / weight and microbatch numerators add up:
      "pg_loss" and "kl" (0 without a reference), aggregated like the loss; "ratio_mean" and "clip_fraction" =
      "clip_fraction_low" + "clip_fraction_high" + "clip_fraction_dual", averaged per token under token-mean and
      per sequence under the seq-mean modes (seq-mean-token-mean, whose weight they share), so they stay means
      whatever the loss's normaliser. A token (for gspo, its sequence) counts as clipped where the clipped term is
      the active one: ratio above 1 + epsilon_high with A > 0, below 1 - epsilon_low with A < 0, above dual_clip
      with A < 0.
  """

  total: jax.Array
  weight: jax.Array
  metrics: dict[str, jax.Array]


def policy_loss(
    logps: jax.Array,
    old_logps: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    algo: str = "grpo",
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    dual_clip: float | None = None,
    ref_logps: jax.Array | None = None,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    agg_mode: str = "token-mean",
    max_length: int | None = None,
) -> PolicyLoss:
  """Clipped surrogate loss, minus the objective J, with an optional KL penalty to a frozen reference.

  With clip(x) = clip(x, 1 - epsilon_low, 1 + epsilon_high) (DAPO's clip-higher when epsilon_high > epsilon_low):
    grpo:        per token, r_t = pi / pi_old and loss_t = max(-r_t A_t, -clip(r_t) A_t) (PPO's surrogate, as in
                 DeepSeekMath's GRPO objective); with dual_clip c, loss_t = min(loss_t, -c A_t) where A_t < 0
                 (Ye et al. 2020), which bounds the loss of tokens whose ratio has grown far past 1.
    gspo:        per sequence, s_i = exp(1/|y_i| sum_t log(pi / pi_old)) and loss_i = max(-s_i A_i, -clip(s_i) A_i)
                 (Zheng et al. 2025, J_GSPO); every token of the sequence carries loss_i, so seq-mean-token-mean
                 gives the paper's 1/G sum_i.
    gspo_token:  per token, s_it = sg[s_i] pi_t / sg[pi_t] and loss_t = max(-s_it A_it, -clip(s_it) A_it) (GSPO-token,
                 same paper): gspo's value, but each token's gradient goes through its own log-prob only, so the
                 advantage may vary along the sequence. With per-sequence advantages its gradient is gspo's (the
                 paper's eqs. 11 and 18) under every agg_mode, since each weighs the tokens of a sequence alike.
  Every token then adds beta * kl_penalty(logps, ref_logps), and the sum is aggregated with `aggregate`.

  Args:
    logps: [N, T] log-probs of the sampled tokens under the policy being trained (differentiated).
    old_logps: [N, T] log-probs under the policy that sampled them (not differentiated).
    advantages: [N] per sequence, or [N, T] per token (grpo and gspo_token only).
    mask: [N, T], nonzero on completion tokens; other entries of the inputs are ignored.
    algo: one of ALGOS.
    epsilon_low: lower clip range, ratio >= 1 - epsilon_low.
    epsilon_high: upper clip range, ratio <= 1 + epsilon_high; None means epsilon_low.
    dual_clip: grpo only; the dual-clip constant c > 1, or None for none.
    ref_logps: [N, T] log-probs under the frozen reference policy, or None for no KL term.
    beta: the KL coefficient; needs ref_logps when > 0.
    kl_estimator: one of KL_ESTIMATORS.
    agg_mode: one of AGG_MODES.
    max_length: the normaliser of seq-mean-token-sum-norm (T if None).

  Returns:
    A PolicyLoss; the loss is total / weight.
  """
  _check_option("algo", algo, ALGOS)
  _check_option("agg_mode", agg_mode, AGG_MODES)
  _check_option("kl_estimator", kl_estimator, KL_ESTIMATORS)
  if dual_clip is not None and algo != "grpo":
    raise ValueError(f"dual_clip={dual_clip} applies to algo 'grpo' only, not {algo!r}.")
  if dual_clip is not None and dual_clip <= 1:
    raise ValueError(f"dual_clip must be > 1, got {dual_clip}.")
  if beta > 0 and ref_logps is None:
    raise ValueError(f"beta={beta} > 0 needs ref_logps for the KL penalty.")
  if logps.ndim != 2 or any(x.shape != logps.shape for x in (old_logps, mask)):
    raise ValueError(f"logps {logps.shape}, old_logps {old_logps.shape} and mask {mask.shape} must all be [N, T].")
  if ref_logps is not None and ref_logps.shape != logps.shape:
    raise ValueError(f"ref_logps {ref_logps.shape} must match logps {logps.shape}.")
  valid_advantage_shapes = [logps.shape[:1]] + ([] if algo == "gspo" else [logps.shape])
  if advantages.shape not in valid_advantage_shapes:
    raise ValueError(f"advantages {advantages.shape} for algo {algo!r} must have a shape in {valid_advantage_shapes}.")
  epsilon_high = epsilon_low if epsilon_high is None else epsilon_high

  mask = jnp.asarray(mask) != 0
  logps = jnp.where(mask, logps.astype(jnp.float32), 0.0)
  log_ratio = logps - jax.lax.stop_gradient(jnp.where(mask, old_logps.astype(jnp.float32), 0.0))
  advantages = advantages.astype(jnp.float32)
  if advantages.ndim == 1:
    advantages = advantages[:, None]
  if algo == "grpo":
    ratio = jnp.exp(log_ratio)
  else:
    seq_log_ratio = jnp.sum(log_ratio, axis=1, keepdims=True) / jnp.maximum(jnp.sum(mask, axis=1, keepdims=True), 1)
    if algo == "gspo":
      ratio = jnp.exp(seq_log_ratio)
    else:
      ratio = jnp.exp(jax.lax.stop_gradient(seq_log_ratio) + logps - jax.lax.stop_gradient(logps))

  loss = jnp.maximum(-ratio * advantages, -jnp.clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * advantages)
  clipped_low = (advantages < 0) & (ratio < 1 - epsilon_low)
  clipped_high = (advantages > 0) & (ratio > 1 + epsilon_high)
  clipped_dual = jnp.zeros_like(clipped_low)
  if dual_clip is not None:
    loss = jnp.where(advantages < 0, jnp.minimum(loss, -dual_clip * advantages), loss)
    clipped_dual = (advantages < 0) & (ratio > dual_clip)

  def aggregated(values: jax.Array, mode: str = agg_mode) -> jax.Array:
    return aggregate(jnp.broadcast_to(values, mask.shape), mask, mode, max_length)[0]

  # The seq-mean modes share one weight, the sequence count, so per-sequence means keep ratios and fractions means.
  mean_mode = "token-mean" if agg_mode == "token-mean" else "seq-mean-token-mean"

  pg_total, weight = aggregate(jnp.broadcast_to(loss, mask.shape), mask, agg_mode, max_length)
  kl_total = jnp.zeros((), jnp.float32)
  if ref_logps is not None:
    ref_logps = jax.lax.stop_gradient(jnp.where(mask, ref_logps.astype(jnp.float32), 0.0))
    kl_total = aggregated(kl_penalty(logps, ref_logps, kl_estimator))
  metrics = {
      "pg_loss": pg_total,
      "kl": kl_total,
      "ratio_mean": aggregated(ratio, mean_mode),
      "clip_fraction": aggregated(clipped_low | clipped_high | clipped_dual, mean_mode),
      "clip_fraction_low": aggregated(clipped_low, mean_mode),
      "clip_fraction_high": aggregated(clipped_high, mean_mode),
      "clip_fraction_dual": aggregated(clipped_dual, mean_mode),
  }
  return PolicyLoss(total=pg_total + beta * kl_total, weight=weight, metrics=metrics)

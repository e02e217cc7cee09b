"""Pairwise preference losses (DPO, IPO, ORPO, SimPO) over summed completion log-probs.

Kept free of models, configs and sharding so that each formula can be checked in isolation against a numpy
reference: the objective computes the per-pair sums of policy (and, for DPO and IPO, frozen reference) log-probs
and hands them here. Length-normalised variants (IPO, SimPO, ORPO) divide those sums by the completion lengths,
so the caller passes sums rather than means and the token counts alongside.
"""

import dataclasses

import jax
import jax.numpy as jnp

ALGOS = ("dpo", "ipo", "orpo", "simpo")

# ORPO's log(1 - p) diverges as a completion's mean log-prob m reaches 0 (p rounds to 1 in float32); m is
# clamped to at most this before the log-odds so that the loss and its gradient stay finite.
_ORPO_MAX_MEAN_LOGP = -1e-12


@dataclasses.dataclass(frozen=True)
class PreferenceLoss:
  """Per-pair losses and implicit rewards (the rewards carry no gradient; they are for logging)."""

  losses: jax.Array
  chosen_rewards: jax.Array
  rejected_rewards: jax.Array


jax.tree_util.register_dataclass(
    PreferenceLoss, data_fields=["losses", "chosen_rewards", "rejected_rewards"], meta_fields=[]
)


def _smoothed_sigmoid_loss(z: jax.Array, label_smoothing: float) -> jax.Array:
  """-log sigmoid(z), with a fraction `label_smoothing` of the pairs' labels assumed flipped (cDPO)."""
  return -(1.0 - label_smoothing) * jax.nn.log_sigmoid(z) - label_smoothing * jax.nn.log_sigmoid(-z)


def _log_odds(mean_logps: jax.Array) -> jax.Array:
  """log(p / (1 - p)) for p = exp(mean_logps), with log(1 - p) as log(-expm1(m)) to stay accurate near p = 1."""
  m = jnp.minimum(mean_logps, _ORPO_MAX_MEAN_LOGP)
  return m - jnp.log(-jnp.expm1(m))


def preference_loss(
    algo: str,
    chosen_logps: jax.Array,
    rejected_logps: jax.Array,
    chosen_lengths: jax.Array,
    rejected_lengths: jax.Array,
    reference_chosen_logps: jax.Array | None = None,
    reference_rejected_logps: jax.Array | None = None,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    orpo_lambda: float = 0.1,
) -> PreferenceLoss:
  """Per-pair preference loss, computed in float32.

  - dpo (Rafailov et al. 2023; cDPO label smoothing, Mitchell 2023): z = beta * (chosen log-ratio - rejected
    log-ratio) against the reference; loss = -(1 - ls) log sigmoid(z) - ls log sigmoid(-z).
  - ipo (Azar et al. 2023), on per-token log-ratios as in TRL: loss = (h - 1 / (2 beta))^2.
  - simpo (Meng et al. 2024), reference-free: z = beta * (chosen - rejected mean log-prob) - simpo_gamma, then the
    DPO loss form.
  - orpo (Hong et al. 2024), reference-free: chosen per-token NLL + orpo_lambda * -log sigmoid(log odds ratio of
    the mean log-probs).

  Args:
    algo: one of ALGOS.
    chosen_logps: [B] sum over completion tokens of the policy's log-probs of the chosen completion.
    rejected_logps: [B] the same for the rejected completion.
    chosen_lengths: [B] completion token counts (>= 1) of the chosen completion.
    rejected_lengths: [B] the same for the rejected completion.
    reference_chosen_logps: [B] summed log-probs under the frozen reference; required for dpo and ipo, ignored
      by orpo and simpo.
    reference_rejected_logps: [B] the same for the rejected completion.
    beta: inverse temperature of the implicit reward (for orpo it only scales the logged rewards).
    label_smoothing: assumed fraction of flipped preference labels (dpo and simpo only).
    simpo_gamma: SimPO's target reward margin.
    orpo_lambda: weight of ORPO's odds-ratio term relative to its SFT term.

  Returns:
    PreferenceLoss of [B] float32 arrays: the losses and beta-scaled implicit rewards (beta * log-ratio for dpo,
    beta * per-token log-ratio for ipo, beta * mean log-prob for simpo and orpo).
  """
  if algo not in ALGOS:
    raise ValueError(f"Unknown preference algo {algo!r}; expected one of {ALGOS}.")
  if algo in ("ipo", "orpo") and label_smoothing != 0.0:
    raise ValueError(f"label_smoothing must be 0 for {algo}, got {label_smoothing}.")
  chosen_logps = jnp.asarray(chosen_logps, jnp.float32)
  rejected_logps = jnp.asarray(rejected_logps, jnp.float32)
  chosen_lengths = jnp.asarray(chosen_lengths, jnp.float32)
  rejected_lengths = jnp.asarray(rejected_lengths, jnp.float32)

  if algo in ("dpo", "ipo"):
    if reference_chosen_logps is None or reference_rejected_logps is None:
      raise ValueError(f"{algo} needs the reference role's log-probs (reference_chosen/rejected_logps).")
    chosen_ratio = chosen_logps - jnp.asarray(reference_chosen_logps, jnp.float32)
    rejected_ratio = rejected_logps - jnp.asarray(reference_rejected_logps, jnp.float32)
    if algo == "dpo":
      losses = _smoothed_sigmoid_loss(beta * (chosen_ratio - rejected_ratio), label_smoothing)
    else:
      chosen_ratio = chosen_ratio / chosen_lengths
      rejected_ratio = rejected_ratio / rejected_lengths
      losses = jnp.square(chosen_ratio - rejected_ratio - 1.0 / (2.0 * beta))
    chosen_rewards, rejected_rewards = beta * chosen_ratio, beta * rejected_ratio
  else:
    chosen_mean = chosen_logps / chosen_lengths
    rejected_mean = rejected_logps / rejected_lengths
    if algo == "simpo":
      losses = _smoothed_sigmoid_loss(beta * (chosen_mean - rejected_mean) - simpo_gamma, label_smoothing)
    else:
      log_odds_ratio = _log_odds(chosen_mean) - _log_odds(rejected_mean)
      losses = -chosen_mean - orpo_lambda * jax.nn.log_sigmoid(log_odds_ratio)
    chosen_rewards, rejected_rewards = beta * chosen_mean, beta * rejected_mean

  return PreferenceLoss(
      losses=losses,
      chosen_rewards=jax.lax.stop_gradient(chosen_rewards),
      rejected_rewards=jax.lax.stop_gradient(rejected_rewards),
  )

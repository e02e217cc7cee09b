"""GRPO-family policy-gradient losses against independent numpy float64 references (values and gradients)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_posttrain import config as config_lib
from maxtext_posttrain.losses import policy_gradient

N, T = 6, 9
EPS_LOW, EPS_HIGH, DUAL_CLIP, BETA = 0.2, 0.28, 3.0, 0.05
# (algo, dual_clip, per-token advantages)
CASES = [
    ("grpo", None, False),
    ("grpo", DUAL_CLIP, False),
    ("grpo", None, True),
    ("gspo", None, False),
    ("gspo_token", None, False),
    ("gspo_token", None, True),
]


def _inputs(seed=0):
  """Rows of 9, 4 (with a hole), 1, 7, 0 and 6 tokens; ratios on both sides of the clip range, some past DUAL_CLIP."""
  rng = np.random.default_rng(seed)
  mask = (np.arange(T)[None, :] < np.array([9, 4, 1, 7, 0, 6])[:, None]).astype(np.float32)
  mask[1, 2] = 0
  logps = -rng.uniform(0.1, 5.0, (N, T))
  # Per-sequence offsets move whole sequences out of the clip range, so gspo clips too.
  shift = rng.normal(0.0, 0.25, (N, T)) + np.array([-0.45, 0.4, 0.1, 0.3, 0.0, -0.1])[:, None]
  shift[3, :3] = -1.5  # token ratios e^1.5 > DUAL_CLIP on a sequence with a negative advantage
  old_logps = logps + shift
  ref_logps = logps + rng.normal(0.0, 0.5, (N, T))
  seq_advantages = np.array([1.2, -0.7, 0.9, -1.1, 0.5, -0.4])
  token_advantages = seq_advantages[:, None] + rng.normal(0.0, 0.5, (N, T))
  arrays = (logps, old_logps, ref_logps, seq_advantages, token_advantages)
  return (*(x.astype(np.float32) for x in arrays), mask)


def _numpy_aggregate(values, mask, mode, max_length):
  """(aggregated value, weight) from the formulas of each mode."""
  values, tokens = np.where(mask > 0, values, 0.0), mask.sum(1)
  if mode == "token-mean":
    return values.sum() / tokens.sum(), tokens.sum()
  per_seq = values.sum(1)[tokens > 0]
  if mode == "seq-mean-token-mean":
    per_seq = per_seq / tokens[tokens > 0]
  elif mode == "seq-mean-token-sum-norm":
    per_seq = per_seq / max_length
  return per_seq.mean(), len(per_seq)


def _numpy_kl(logps, ref_logps, estimator):
  d = logps - ref_logps
  return {"k1": d, "k2": d**2 / 2, "k3": np.exp(-d) + d - 1}[estimator]


def _numpy_ratio(logps, old_logps, mask, algo, anchor):
  """Token ratios pi/pi_old, or the sequence ratio (geometric mean over the sequence's tokens) on every token.

  gspo_token's stop-gradients are values frozen at `anchor`: s_it = s_i(anchor) * exp(logps_t - anchor_t).
  """
  log_ratio = np.where(mask > 0, logps - old_logps, 0.0)
  if algo == "grpo":
    return np.exp(log_ratio)
  frozen = anchor if algo == "gspo_token" else logps
  seq = np.where(mask > 0, frozen - old_logps, 0.0).sum(1) / np.maximum(mask.sum(1), 1)
  ratio = np.exp(seq)[:, None] * np.ones((1, T))
  return ratio * np.exp(logps - anchor) if algo == "gspo_token" else ratio


def _numpy_policy_loss(
    logps,
    old_logps,
    adv,
    mask,
    *,
    algo,
    epsilon_low,
    epsilon_high,
    dual_clip,
    ref_logps,
    beta,
    kl_estimator,
    agg_mode,
    max_length,
    anchor=None
):
  """(loss, weight, {metric: value}) in float64, written from the papers' formulas."""
  logps, old_logps, adv = (np.asarray(x, np.float64) for x in (logps, old_logps, adv))
  adv = adv[:, None] * np.ones((1, T)) if adv.ndim == 1 else adv
  ratio = _numpy_ratio(logps, old_logps, mask, algo, logps if anchor is None else anchor)
  pg = -np.minimum(ratio * adv, np.clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * adv)
  if dual_clip is not None:
    pg = np.where(adv < 0, np.minimum(pg, -dual_clip * adv), pg)
  kl = _numpy_kl(logps, np.asarray(ref_logps, np.float64), kl_estimator)
  loss, weight = _numpy_aggregate(pg + beta * kl, mask, agg_mode, max_length)
  low = (adv < 0) & (ratio < 1 - epsilon_low)
  high = (adv > 0) & (ratio > 1 + epsilon_high)
  dual = (adv < 0) & (ratio > (np.inf if dual_clip is None else dual_clip))
  # Ratios and clip indicators are plain means: over tokens, or over sequences of their per-sequence means.
  mean_mode = agg_mode if agg_mode == "token-mean" else "seq-mean-token-mean"

  def mean(values):
    return _numpy_aggregate(values.astype(np.float64), mask, mean_mode, None)[0]

  metrics = {
      "pg_loss": _numpy_aggregate(pg, mask, agg_mode, max_length)[0],
      "kl": _numpy_aggregate(kl, mask, agg_mode, max_length)[0],
      "ratio_mean": mean(ratio),
      "clip_fraction": mean(low | high | dual),
      "clip_fraction_low": mean(low),
      "clip_fraction_high": mean(high),
      "clip_fraction_dual": mean(dual),
  }
  return loss, weight, metrics


def _central_differences(f, x, mask, h=1e-6):
  """df/dx on the mask's tokens; 0 elsewhere, where the losses ignore their inputs."""
  grad = np.zeros_like(x)
  for i in zip(*np.nonzero(mask)):
    step = np.zeros_like(x)
    step[i] = h
    grad[i] = (f(x + step) - f(x - step)) / (2 * h)
  return grad


def _jax_loss(logps, old_logps, adv, mask, **kwargs):
  out = policy_gradient.policy_loss(logps, old_logps, adv, mask, **kwargs)
  return out.total / out.weight, out


def test_inputs_stay_off_the_clip_kinks_and_clip_every_way():
  """Finite differences need the ratios away from the kinks; the value tests need every clip branch taken."""
  logps, old_logps, _, seq_adv, _, mask = _inputs()
  kinks = np.array([1 - EPS_LOW, 1 + EPS_HIGH, DUAL_CLIP])
  kwargs = {"epsilon_low": EPS_LOW, "epsilon_high": EPS_HIGH, "dual_clip": DUAL_CLIP, "ref_logps": logps, "beta": 0.0}
  kwargs.update(kl_estimator="k1", agg_mode="token-mean", max_length=T)
  for algo in ("grpo", "gspo"):
    ratio = _numpy_ratio(logps.astype(np.float64), old_logps, mask, algo, logps)[mask > 0]
    assert np.min(np.abs(ratio[:, None] - kinks)) > 1e-3
    metrics = _numpy_policy_loss(logps, old_logps, seq_adv, mask, algo=algo, **kwargs)[2]
    assert metrics["clip_fraction_low"] > 0 and metrics["clip_fraction_high"] > 0 and metrics["clip_fraction"] < 1
    assert (metrics["clip_fraction_dual"] > 0) == (algo == "grpo")  # row 3's sequence ratio stays under DUAL_CLIP


@pytest.mark.parametrize("kl", policy_gradient.KL_ESTIMATORS)
@pytest.mark.parametrize("agg", policy_gradient.AGG_MODES)
@pytest.mark.parametrize("algo,dual_clip,per_token", CASES)
def test_policy_loss_matches_numpy(algo, dual_clip, per_token, agg, kl):
  logps, old_logps, ref_logps, seq_adv, token_adv, mask = _inputs()
  adv = token_adv if per_token else seq_adv
  kwargs = {"algo": algo, "epsilon_low": EPS_LOW, "epsilon_high": EPS_HIGH, "dual_clip": dual_clip}
  kwargs.update(ref_logps=ref_logps, beta=BETA, kl_estimator=kl, agg_mode=agg, max_length=T + 3)

  (loss, out), grad = jax.value_and_grad(_jax_loss, has_aux=True)(jnp.asarray(logps), old_logps, adv, mask, **kwargs)
  ref_loss, ref_weight, ref_metrics = _numpy_policy_loss(logps, old_logps, adv, mask, **kwargs)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out.weight, ref_weight)
  for key, value in ref_metrics.items():
    np.testing.assert_allclose(out.metrics[key] / out.weight, value, rtol=1e-5, atol=1e-6, err_msg=key)
  np.testing.assert_allclose(out.total, out.metrics["pg_loss"] + BETA * out.metrics["kl"], rtol=1e-6, atol=1e-7)

  anchor = logps.astype(np.float64)
  ref_grad = _central_differences(
      lambda x: _numpy_policy_loss(x, old_logps, adv, mask, anchor=anchor, **kwargs)[0], anchor, mask
  )
  np.testing.assert_allclose(grad, ref_grad, rtol=1e-3, atol=1e-5)
  assert np.all(np.asarray(grad)[mask == 0] == 0)


@pytest.mark.parametrize("agg", policy_gradient.AGG_MODES)
def test_gspo_token_with_sequence_advantages_is_gspo(agg):
  """GSPO paper, eqs. 11 and 18: the same value and the same gradient when every token of a sequence shares A_i."""
  logps, old_logps, ref_logps, seq_adv, _, mask = _inputs(seed=1)
  kwargs = {"epsilon_low": EPS_LOW, "epsilon_high": EPS_HIGH, "ref_logps": ref_logps, "beta": BETA, "agg_mode": agg}
  grad_fn = jax.value_and_grad(_jax_loss, has_aux=True)
  (gspo, _), gspo_grad = grad_fn(jnp.asarray(logps), old_logps, seq_adv, mask, algo="gspo", **kwargs)
  (token, _), token_grad = grad_fn(jnp.asarray(logps), old_logps, seq_adv, mask, algo="gspo_token", **kwargs)
  np.testing.assert_allclose(token, gspo, rtol=1e-6)
  np.testing.assert_allclose(token_grad, gspo_grad, rtol=1e-5, atol=1e-7)
  assert np.abs(np.asarray(gspo_grad)).max() > 0


@pytest.mark.parametrize("agg", policy_gradient.AGG_MODES)
@pytest.mark.parametrize("algo", policy_gradient.ALGOS)
def test_first_iteration_gradient_is_the_plain_policy_gradient(algo, agg):
  """With old_logps == logps every ratio is 1, nothing is clipped and d loss / d logps = -A mask / normaliser."""
  logps, _, _, seq_adv, _, mask = _inputs()
  max_length = 12
  (_, out), grad = jax.value_and_grad(_jax_loss, has_aux=True)(
      jnp.asarray(logps), logps, seq_adv, mask, algo=algo, agg_mode=agg, max_length=max_length
  )
  assert isinstance(out, policy_gradient.PolicyLoss)
  np.testing.assert_allclose(out.metrics["ratio_mean"], out.weight, rtol=1e-6)
  assert out.metrics["clip_fraction"] == 0 and out.metrics["kl"] == 0

  tokens = mask.sum(1, keepdims=True)
  sequences = np.sum(tokens > 0)
  normaliser = {
      "token-mean": mask.sum(),
      "seq-mean-token-mean": np.maximum(tokens, 1) * sequences,
      "seq-mean-token-sum": sequences,
      "seq-mean-token-sum-norm": max_length * sequences,
  }[agg]
  np.testing.assert_allclose(grad, -seq_adv[:, None] * mask / normaliser, rtol=1e-5, atol=1e-8)


def test_entries_outside_the_mask_are_ignored():
  logps, old_logps, ref_logps, seq_adv, token_adv, mask = _inputs()

  def garbage(x, fill):
    return np.where(mask > 0, x, fill).astype(np.float32)

  for algo, adv in (("grpo", token_adv), ("gspo", seq_adv), ("gspo_token", token_adv)):
    kwargs = {"algo": algo, "beta": BETA, "kl_estimator": "k3"}
    grad_fn = jax.value_and_grad(_jax_loss, has_aux=True)
    (clean, _), clean_grad = grad_fn(jnp.asarray(logps), old_logps, adv, mask, ref_logps=ref_logps, **kwargs)
    dirty_logps, dirty_old, dirty_ref = garbage(logps, 300.0), garbage(old_logps, -np.inf), garbage(ref_logps, -1e30)
    (dirty, _), dirty_grad = grad_fn(jnp.asarray(dirty_logps), dirty_old, adv, mask, ref_logps=dirty_ref, **kwargs)
    np.testing.assert_allclose(dirty, clean, rtol=1e-6)
    np.testing.assert_allclose(dirty_grad, clean_grad, rtol=1e-6)


@pytest.mark.parametrize("mode", policy_gradient.AGG_MODES)
def test_aggregate_microbatches_add_up_to_the_batch(mode):
  rng = np.random.default_rng(2)
  values = rng.normal(size=(N, T)).astype(np.float32)
  mask = (rng.random((N, T)) > 0.4).astype(np.float32)
  mask[4] = 0
  values[mask == 0] = np.nan  # ignored outside the mask
  total, weight = policy_gradient.aggregate(jnp.asarray(values), mask, mode, max_length=11)
  ref, ref_weight = _numpy_aggregate(values.astype(np.float64), mask, mode, 11)
  np.testing.assert_allclose(total / weight, ref, rtol=1e-5)
  np.testing.assert_allclose(weight, ref_weight)

  halves = [
      policy_gradient.aggregate(jnp.asarray(values[rows]), mask[rows], mode, max_length=11)
      for rows in (slice(0, 2), slice(2, N))
  ]
  np.testing.assert_allclose(sum(t for t, _ in halves), total, rtol=1e-6)
  np.testing.assert_allclose(sum(w for _, w in halves), weight)


def test_sum_norm_defaults_to_the_padded_length():
  values, mask = jnp.ones((2, 5)), jnp.asarray([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])
  total, weight = policy_gradient.aggregate(values, mask, "seq-mean-token-sum-norm")
  np.testing.assert_allclose(total / weight, (2 / 5 + 4 / 5) / 2, rtol=1e-6)


# The rl.loss_agg_mode spellings that Tunix defines (google-tunix 0.1.7, tunix/rl/common.py aggregate_loss, where
# MaxText's rl.yml sends the key) and verl's (verl 0.9.1, verl/trainer/ppo/core_algos.py agg_loss).
TUNIX_MODES = (
    "token-mean",
    "sequence-mean-token-mean",
    "sequence-mean-token-scale",
    "seq-mean-token-sum",
    "sequence-mean-token-sum-norm",
)
VERL_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
PROMPT, BUDGET = 3, 7  # prompt positions before each completion, and the generation budget


def _tunix_aggregate(values, mask, mode):
  """Tunix's aggregate_loss as its GRPO loss calls it (no `norm`), on completions padded to the budget as Tunix pads
  them (`max_tokens_to_generate`), so the row width is the budget."""
  masked, tokens = values * mask, mask.sum(1)
  non_zero_rows = max(np.sum(tokens > 0), 1)
  if mode == "token-mean":
    return masked.sum() / max(mask.sum(), 1)
  if mode == "sequence-mean-token-mean":
    return np.sum(masked.sum(1) / np.maximum(tokens, 1)) / non_zero_rows
  if mode == "sequence-mean-token-scale":  # norm defaults to the row width
    return np.sum(masked.sum(1) / masked.shape[-1]) / non_zero_rows
  if mode == "seq-mean-token-sum":
    return np.sum(masked.sum(1) * (tokens > 0)) / max(np.sum(tokens > 0), 1e-6)
  assert mode == "sequence-mean-token-sum-norm"  # norm defaults to the non-empty rows
  return masked.sum() / non_zero_rows


def _verl_agg_loss(values, mask, mode):
  """verl's agg_loss on one data-parallel rank, with no global batch sizes and no loss_scale_factor."""
  masked, tokens = values * mask, mask.sum(1)
  seq_mask = tokens > 0
  if mode == "token-mean":
    return masked.sum() / mask.sum()
  if mode == "seq-mean-token-mean":
    return np.sum((masked.sum(1) / (tokens + 1e-8))[seq_mask]) / seq_mask.sum()
  loss = np.sum(masked.sum(1)[seq_mask]) / seq_mask.sum()
  assert mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm")
  return loss / mask.shape[-1] if mode == "seq-mean-token-sum-norm" else loss  # loss_scale_factor: the row width


def test_the_accepted_spellings_are_tunixs_and_verls():
  assert set(config_lib.AGG_MODE_ALIASES) == set(TUNIX_MODES + VERL_MODES)


@pytest.mark.parametrize("spelling", sorted(set(TUNIX_MODES + VERL_MODES)))
def test_each_spelling_keeps_the_meaning_of_the_library_that_defines_it(spelling):
  """Completion values as Tunix and verl see them ([N, BUDGET]) against ours: the same completions after PROMPT
  positions, aggregated with max_length=BUDGET; value, gradient, and microbatches adding up to the batch."""
  rng = np.random.default_rng(4)
  lengths = np.array([7, 3, 1, 0, 5, 6])  # a full-budget completion, an empty row
  mask = (np.arange(BUDGET)[None, :] < lengths[:, None]).astype(np.float64)
  values = rng.normal(size=(N, BUDGET))
  ours_mask = np.pad(mask, ((0, 0), (PROMPT, 0))).astype(np.float32)
  ours_values = np.pad(values, ((0, 0), (PROMPT, 0)), constant_values=np.nan).astype(np.float32)
  mode = config_lib.AGG_MODE_ALIASES[spelling]

  def loss(x):
    total, weight = policy_gradient.aggregate(x, ours_mask, mode, max_length=BUDGET)
    return total / weight

  value, grad = jax.value_and_grad(loss)(jnp.asarray(ours_values))
  libraries = [f for modes, f in ((TUNIX_MODES, _tunix_aggregate), (VERL_MODES, _verl_agg_loss)) if spelling in modes]
  for reference in libraries:
    np.testing.assert_allclose(value, reference(values, mask, spelling), rtol=1e-5)
    ref_grad = _central_differences(lambda x, f=reference: f(x, mask, spelling), values, mask)
    np.testing.assert_allclose(grad[:, PROMPT:], ref_grad, rtol=1e-4, atol=1e-7)
  assert np.all(np.asarray(grad)[ours_mask == 0] == 0)

  batch = policy_gradient.aggregate(jnp.asarray(ours_values), ours_mask, mode, max_length=BUDGET)
  halves = [
      policy_gradient.aggregate(jnp.asarray(ours_values[rows]), ours_mask[rows], mode, max_length=BUDGET)
      for rows in (slice(0, 4), slice(4, N))
  ]
  np.testing.assert_allclose([sum(t for t, _ in halves), sum(w for _, w in halves)], batch, rtol=1e-6)


@pytest.mark.parametrize("estimator", policy_gradient.KL_ESTIMATORS)
def test_kl_penalty(estimator):
  rng = np.random.default_rng(3)
  logps, ref_logps = -rng.uniform(0.0, 8.0, (2, N, T)).astype(np.float32)
  got = policy_gradient.kl_penalty(jnp.asarray(logps), jnp.asarray(ref_logps), estimator)
  np.testing.assert_allclose(got, _numpy_kl(logps.astype(np.float64), ref_logps, estimator), rtol=1e-5, atol=1e-6)
  if estimator == "k3":
    assert np.all(np.asarray(got) >= 0)

  # Over tokens drawn from p, k1 and k3 average to KL(p || q) exactly.
  p, q = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(2, 7)), jnp.float32))
  expected = policy_gradient.kl_penalty(p, q, estimator) @ jnp.exp(p)
  if estimator != "k2":
    np.testing.assert_allclose(expected, jnp.exp(p) @ (p - q), rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"algo": "ppo"}, "algo 'ppo'.*'grpo', 'gspo', 'gspo_token'"),
        ({"agg_mode": "mean"}, "agg_mode 'mean'"),
        ({"kl_estimator": "k4"}, "kl_estimator 'k4'.*'k1', 'k2', 'k3'"),
        ({"dual_clip": 1.0}, "dual_clip must be > 1, got 1.0"),
        ({"dual_clip": 3.0, "algo": "gspo"}, "dual_clip=3.0.*'gspo'"),
        ({"beta": 0.1}, "beta=0.1 > 0 needs ref_logps"),
        ({"old_logps": np.zeros((N, T + 1))}, r"old_logps \(6, 10\)"),
        ({"mask": np.ones((N - 1, T))}, r"mask \(5, 9\)"),
        ({"ref_logps": np.zeros((N, 1))}, r"ref_logps \(6, 1\)"),
        ({"advantages": np.zeros(N + 1)}, r"advantages \(7,\)"),
        ({"advantages": np.zeros((N, T)), "algo": "gspo"}, r"advantages \(6, 9\) for algo 'gspo'"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
  args = {"logps": np.zeros((N, T)), "old_logps": np.zeros((N, T)), "advantages": np.zeros(N), "mask": np.ones((N, T))}
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    policy_gradient.policy_loss(**args)


def test_aggregate_rejects_an_unknown_mode():
  with pytest.raises(ValueError, match="agg_mode 'sum'"):
    policy_gradient.aggregate(jnp.ones((2, 3)), jnp.ones((2, 3)), "sum")

"""Preference losses against an independent float64 numpy reference (values and gradients)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_posttrain.losses import preference

B = 7


def _log_sigmoid(z):
  return -np.logaddexp(0.0, -z)


def _numpy_losses(algo, c, r, lc, lr, rc, rr, beta, ls, gamma, lam):
  """Per-pair losses in float64, written from the papers' formulas (ORPO's log(1 - p) as log1p(-exp(m)))."""
  if algo == "dpo":
    z = beta * ((c - rc) - (r - rr))
    return -(1 - ls) * _log_sigmoid(z) - ls * _log_sigmoid(-z)
  if algo == "ipo":
    return ((c - rc) / lc - (r - rr) / lr - 1 / (2 * beta)) ** 2
  mc, mr = c / lc, r / lr
  if algo == "simpo":
    z = beta * (mc - mr) - gamma
    return -(1 - ls) * _log_sigmoid(z) - ls * _log_sigmoid(-z)
  log_odds = (mc - np.log1p(-np.exp(mc))) - (mr - np.log1p(-np.exp(mr)))
  return -mc - lam * _log_sigmoid(log_odds)


def _numpy_rewards(algo, c, r, lc, lr, rc, rr, beta):
  if algo == "dpo":
    return beta * (c - rc), beta * (r - rr)
  if algo == "ipo":
    return beta * (c - rc) / lc, beta * (r - rr) / lr
  return beta * c / lc, beta * r / lr


def _inputs(seed):
  """float32 arrays: policy sums -U(5, 60), reference sums near them (moderate log-ratios), lengths 3..20."""
  rng = np.random.default_rng(seed)
  c, r = (-rng.uniform(5, 60, B)).astype(np.float32), (-rng.uniform(5, 60, B)).astype(np.float32)
  rc, rr = (c + rng.normal(0, 2, B)).astype(np.float32), (r + rng.normal(0, 2, B)).astype(np.float32)
  lc, lr = rng.integers(3, 21, B).astype(np.float32), rng.integers(3, 21, B).astype(np.float32)
  return c, r, lc, lr, rc, rr


CASES = [
    (algo, beta, ls)
    for algo in preference.ALGOS
    for beta in (0.1, 0.5, 2.0)
    for ls in ((0.0, 0.1) if algo in ("dpo", "simpo") else (0.0,))
]


@pytest.mark.parametrize("algo,beta,ls", CASES)
def test_matches_numpy_values_and_gradients(algo, beta, ls):
  c, r, lc, lr, rc, rr = _inputs(seed=CASES.index((algo, beta, ls)))
  gamma, lam = 0.3, 0.2
  refs = (rc, rr) if algo in ("dpo", "ipo") else (None, None)

  @jax.jit
  def loss_fn(chosen, rejected):
    return preference.preference_loss(
        algo, chosen, rejected, lc, lr, *refs, beta=beta, label_smoothing=ls, simpo_gamma=gamma, orpo_lambda=lam
    )

  out = loss_fn(c, r)
  f64 = [x.astype(np.float64) for x in (c, r, lc, lr, rc, rr)]
  ref = _numpy_losses(algo, *f64, beta, ls, gamma, lam)
  assert out.losses.dtype == jnp.float32 and out.losses.shape == (B,)
  np.testing.assert_allclose(out.losses, ref, rtol=1e-5, atol=1e-6)
  ref_chosen_rewards, ref_rejected_rewards = _numpy_rewards(algo, *f64, beta)
  np.testing.assert_allclose(out.chosen_rewards, ref_chosen_rewards, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out.rejected_rewards, ref_rejected_rewards, rtol=1e-5, atol=1e-6)

  grad_c, grad_r = jax.grad(lambda x, y: jnp.sum(loss_fn(x, y).losses), argnums=(0, 1))(c, r)
  for i, grad in enumerate((grad_c, grad_r)):
    # Each pair's loss depends only on its own inputs, so shifting a whole vector gives every partial derivative.
    eps = np.zeros(6)
    eps[i] = 1e-6
    plus = _numpy_losses(algo, *(x + e for x, e in zip(f64, eps)), beta, ls, gamma, lam)
    minus = _numpy_losses(algo, *(x - e for x, e in zip(f64, eps)), beta, ls, gamma, lam)
    np.testing.assert_allclose(grad, (plus - minus) / 2e-6, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("algo", preference.ALGOS)
def test_rewards_carry_no_gradient_and_low_precision_inputs_compute_in_float32(algo):
  c, r, lc, lr, rc, rr = (jnp.asarray(x, jnp.bfloat16) for x in _inputs(seed=3))
  refs = (rc, rr) if algo in ("dpo", "ipo") else (None, None)

  def rewards(chosen, rejected):
    out = preference.preference_loss(algo, chosen, rejected, lc, lr, *refs, beta=0.5)
    assert out.losses.dtype == out.chosen_rewards.dtype == jnp.float32
    return jnp.sum(out.chosen_rewards + out.rejected_rewards)

  grads = jax.grad(rewards, argnums=(0, 1))(c.astype(jnp.float32), r.astype(jnp.float32))
  assert all(np.all(np.asarray(g) == 0) for g in grads)
  rewards(c, r)


@pytest.mark.parametrize("mean_logp", [-1e-7, 0.0])
@pytest.mark.parametrize("side", ["chosen", "rejected"])
def test_orpo_is_finite_when_mean_logp_is_near_zero(mean_logp, side):
  c, r, lc, lr, _, _ = _inputs(seed=4)
  if side == "chosen":
    c = (mean_logp * lc).astype(np.float32)
  else:
    r = (mean_logp * lr).astype(np.float32)

  def loss(chosen, rejected):
    return jnp.sum(preference.preference_loss("orpo", chosen, rejected, lc, lr, beta=0.1).losses)

  value, grads = jax.value_and_grad(loss, argnums=(0, 1))(c, r)
  assert np.isfinite(value) and all(np.all(np.isfinite(g)) for g in grads)
  if mean_logp != 0.0:
    f64 = [x.astype(np.float64) for x in (c, r, lc, lr)]
    np.testing.assert_allclose(value, _numpy_losses("orpo", *f64, None, None, 0.1, 0.0, 0.0, 0.1).sum(), rtol=1e-5)


def test_errors():
  c, r, lc, lr, rc, rr = _inputs(seed=5)
  with pytest.raises(ValueError, match="dpo.*ipo.*orpo.*simpo"):
    preference.preference_loss("kto", c, r, lc, lr, rc, rr, beta=0.1)
  for algo in ("dpo", "ipo"):
    with pytest.raises(ValueError, match="reference role"):
      preference.preference_loss(algo, c, r, lc, lr, beta=0.1)
    with pytest.raises(ValueError, match="reference role"):
      preference.preference_loss(algo, c, r, lc, lr, rc, None, beta=0.1)
  with pytest.raises(ValueError, match="label_smoothing"):
    preference.preference_loss("ipo", c, r, lc, lr, rc, rr, beta=0.1, label_smoothing=0.1)
  with pytest.raises(ValueError, match="label_smoothing"):
    preference.preference_loss("orpo", c, r, lc, lr, beta=0.1, label_smoothing=0.1)

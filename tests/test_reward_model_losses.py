"""The Bradley-Terry reward-model loss against an independent numpy float64 reference (values and gradients)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_posttrain.losses import reward_model

B = 8


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  chosen = rng.normal(0.5, 1.5, B).astype(np.float32)
  rejected = rng.normal(0.0, 1.5, B).astype(np.float32)
  rejected[3] = chosen[3]  # a tie
  margin = rng.uniform(0.0, 1.0, B).astype(np.float32)
  valid = np.array([1, 1, 1, 1, 0, 1, 1, 0], bool)  # two padding pairs
  return chosen, rejected, margin, valid


def _numpy_bradley_terry(chosen, rejected, margin, centering_coef, valid):
  """(loss, weight, {metric: mean}, d loss / d chosen, d loss / d rejected), pair by pair in float64.

  With z = r_c - r_r - m: -log sigmoid(z) = log(1 + e^-z), whose derivative in z is -sigmoid(-z) = -1 / (1 + e^z).
  """
  total, weight = 0.0, 0
  sums = {"accuracy": 0.0, "margin": 0.0, "chosen": 0.0, "rejected": 0.0}
  grad_chosen, grad_rejected = np.zeros(B), np.zeros(B)
  for i in range(B):
    if not valid[i]:
      continue
    c, r, m = float(chosen[i]), float(rejected[i]), 0.0 if margin is None else float(margin[i])
    z = c - r - m
    total += math.log1p(math.exp(-z)) + centering_coef * (c + r) ** 2
    weight += 1
    sums["accuracy"] += 1.0 if c > r else 0.5 if c == r else 0.0
    sums["margin"] += c - r
    sums["chosen"] += c
    sums["rejected"] += r
    grad_chosen[i] = -1.0 / (1.0 + math.exp(z)) + 2 * centering_coef * (c + r)
    grad_rejected[i] = 1.0 / (1.0 + math.exp(z)) + 2 * centering_coef * (c + r)
  means = {key: value / weight for key, value in sums.items()}
  return total / weight, weight, means, grad_chosen / weight, grad_rejected / weight


def _loss(chosen, rejected, **kwargs):
  out = reward_model.bradley_terry(chosen, rejected, **kwargs)
  return out.total / out.weight, out


@pytest.mark.parametrize("use_margin", [False, True])
@pytest.mark.parametrize("centering_coef", [0.0, 0.01])
@pytest.mark.parametrize("use_valid", [False, True])
def test_bradley_terry_matches_numpy(use_margin, centering_coef, use_valid):
  chosen, rejected, margin, valid = _inputs()
  margin = margin if use_margin else None
  valid = valid if use_valid else None
  if use_valid:  # padding pairs are ignored, even if not finite
    chosen, rejected = np.where(valid, chosen, np.nan), np.where(valid, rejected, np.inf)
    margin = None if margin is None else np.where(valid, margin, -np.inf)
  kwargs = {"margin": margin, "centering_coef": centering_coef, "valid": valid}

  (loss, out), (grad_chosen, grad_rejected) = jax.value_and_grad(_loss, argnums=(0, 1), has_aux=True)(
      jnp.asarray(chosen), jnp.asarray(rejected), **kwargs
  )
  ref_valid = np.ones(B, bool) if valid is None else valid
  ref_loss, ref_weight, ref_metrics, ref_grad_chosen, ref_grad_rejected = _numpy_bradley_terry(
      chosen, rejected, margin, centering_coef, ref_valid
  )
  assert isinstance(out, reward_model.RewardModelLoss)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  np.testing.assert_allclose(out.weight, ref_weight)
  for key, value in ref_metrics.items():
    np.testing.assert_allclose(out.metrics[key] / out.weight, value, rtol=1e-5, atol=1e-6, err_msg=key)
  np.testing.assert_allclose(grad_chosen, ref_grad_chosen, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(grad_rejected, ref_grad_rejected, rtol=1e-5, atol=1e-7)
  assert np.all(np.isfinite(grad_chosen)) and np.all(np.isfinite(grad_rejected))


def test_bradley_terry_against_finite_differences():
  """The analytic numpy gradient above, checked once more against central differences of the numpy loss."""
  chosen, rejected, margin, valid = _inputs(seed=1)
  _, grads = jax.value_and_grad(_loss, argnums=(0, 1), has_aux=True)(
      jnp.asarray(chosen), jnp.asarray(rejected), margin=margin, centering_coef=0.05, valid=valid
  )
  h = 1e-6
  for argnum, grad in enumerate(grads):
    args = [chosen.astype(np.float64), rejected.astype(np.float64)]
    ref = np.zeros(B)
    for i in range(B):
      plus, minus = [a.copy() for a in args], [a.copy() for a in args]
      plus[argnum][i] += h
      minus[argnum][i] -= h
      ref[i] = (
          _numpy_bradley_terry(*plus, margin, 0.05, valid)[0] - _numpy_bradley_terry(*minus, margin, 0.05, valid)[0]
      ) / (2 * h)
    np.testing.assert_allclose(grad, ref, rtol=1e-4, atol=1e-7)


def test_bradley_terry_by_hand():
  """r_c = 2, r_r = 0: loss log(1 + e^-2) = 0.126928; with margin 1, log(1 + e^-1) = 0.313262; centering 0.1 adds
  0.1 * (2 + 0)^2 = 0.4. A tie counts half towards accuracy, a loss not at all."""
  out = reward_model.bradley_terry(jnp.array([2.0]), jnp.array([0.0]))
  np.testing.assert_allclose(out.total, math.log1p(math.exp(-2.0)), rtol=1e-6)
  out = reward_model.bradley_terry(jnp.array([2.0]), jnp.array([0.0]), margin=jnp.array([1.0]), centering_coef=0.1)
  np.testing.assert_allclose(out.total, math.log1p(math.exp(-1.0)) + 0.4, rtol=1e-6)
  out = reward_model.bradley_terry(jnp.array([1.0, 0.5, -1.0]), jnp.array([0.0, 0.5, 0.0]))
  np.testing.assert_allclose(out.metrics["accuracy"], 1.5)
  np.testing.assert_allclose(out.metrics["margin"], 0.0)
  np.testing.assert_allclose([out.metrics["chosen"], out.metrics["rejected"]], [0.5, 0.5])


def test_margin_carries_no_gradient():
  chosen, rejected, margin, valid = _inputs()

  def total(margin):
    return reward_model.bradley_terry(chosen, rejected, margin=margin, valid=valid).total

  np.testing.assert_array_equal(jax.grad(total)(jnp.asarray(margin)), 0)


def test_microbatches_add_up_to_the_batch():
  chosen, rejected, margin, valid = _inputs(seed=2)
  kwargs = {"centering_coef": 0.01}
  batch = reward_model.bradley_terry(chosen, rejected, margin=margin, valid=valid, **kwargs)
  halves = [
      reward_model.bradley_terry(chosen[rows], rejected[rows], margin=margin[rows], valid=valid[rows], **kwargs)
      for rows in (slice(0, 3), slice(3, B))
  ]
  np.testing.assert_allclose(sum(h.total for h in halves), batch.total, rtol=1e-6)
  np.testing.assert_allclose(sum(h.weight for h in halves), batch.weight)
  for key in batch.metrics:
    np.testing.assert_allclose(sum(h.metrics[key] for h in halves), batch.metrics[key], rtol=1e-6, atol=1e-6)


def test_all_padding_gives_zero_weight_and_jits():
  out = jax.jit(reward_model.bradley_terry)(jnp.full(4, jnp.nan), jnp.zeros(4), valid=jnp.zeros(4, bool))
  assert isinstance(out, reward_model.RewardModelLoss)
  assert out.total == 0 and out.weight == 0 and all(v == 0 for v in out.metrics.values())


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"rejected_rewards": np.zeros(B + 1)}, r"rejected_rewards \(9,\)"),
        ({"chosen_rewards": np.zeros((B, 1)), "rejected_rewards": np.zeros((B, 1))}, r"must be \[B\]"),
        ({"margin": np.zeros(B - 1)}, r"margin \(7,\)"),
        ({"valid": np.ones((B, 2), bool)}, r"valid \(8, 2\)"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
  args = {"chosen_rewards": np.zeros(B), "rejected_rewards": np.zeros(B)}
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    reward_model.bradley_terry(**args)

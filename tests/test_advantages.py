"""Group-relative advantages against independent numpy references (values and gradients)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_posttrain.losses import advantages

GROUP = 4


def _numpy_advantages(rewards, group_size, estimator, scale_by_std, epsilon):
  """Group by group, from the formulas: GRPO (r - mean) / (std + eps), Dr.GRPO r - mean, RLOO leave-one-out."""
  rewards = np.asarray(rewards, np.float64)
  out = np.empty_like(rewards)
  for start in range(0, len(rewards), group_size):
    r = rewards[start : start + group_size]
    if estimator == "rloo":
      out[start : start + group_size] = [r[i] - np.delete(r, i).mean() for i in range(group_size)]
    else:
      centred = r - r.sum() / group_size
      std = np.sqrt(np.sum(centred**2) / group_size)
      out[start : start + group_size] = centred / (std + epsilon) if scale_by_std else centred
  return out


def _central_differences(f, x, h=1e-6):
  grad = np.zeros_like(x)
  for i in range(x.size):
    step = np.zeros_like(x)
    step.flat[i] = h
    grad.flat[i] = (f(x + step) - f(x - step)) / (2 * h)
  return grad


@pytest.mark.parametrize("estimator,scale_by_std", [("grpo", True), ("grpo", False), ("rloo", True), ("rloo", False)])
def test_group_advantages_match_numpy(estimator, scale_by_std):
  rng = np.random.default_rng(0)
  rewards = rng.normal(size=3 * GROUP).astype(np.float32)
  probe = rng.normal(size=3 * GROUP)  # d <probe, A> / d rewards checks the whole Jacobian at once
  kwargs = {"estimator": estimator, "scale_by_std": scale_by_std, "epsilon": 1e-4}

  got = advantages.group_advantages(jnp.asarray(rewards), GROUP, **kwargs)
  assert got.shape == rewards.shape and got.dtype == jnp.float32
  np.testing.assert_allclose(got, _numpy_advantages(rewards, GROUP, estimator, scale_by_std, 1e-4), rtol=1e-5, atol=1e-6)

  grad = jax.grad(lambda r: jnp.sum(probe * advantages.group_advantages(r, GROUP, **kwargs)))(jnp.asarray(rewards))
  ref = _central_differences(
      lambda r: np.sum(probe * _numpy_advantages(r, GROUP, estimator, scale_by_std, 1e-4)), rewards.astype(np.float64)
  )
  np.testing.assert_allclose(grad, ref, rtol=1e-3, atol=1e-5)


def test_group_statistics_do_not_mix_groups():
  rewards = jnp.asarray([1.0, 0.0, 0.0, 0.0, 5.0, 5.0, 5.0, 5.0])
  grpo = advantages.group_advantages(rewards, GROUP)
  np.testing.assert_allclose(grpo[:GROUP], np.array([3.0, -1.0, -1.0, -1.0]) / (np.sqrt(3) + 1e-4 * 4), rtol=1e-5)
  np.testing.assert_array_equal(grpo[GROUP:], 0.0)
  rloo = advantages.group_advantages(rewards, GROUP, estimator="rloo")
  np.testing.assert_allclose(rloo, [1.0, -1 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0, 0.0], rtol=1e-6)


def test_zero_variance_groups():
  rewards = jnp.asarray([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.50001])
  np.testing.assert_array_equal(advantages.zero_variance_groups(rewards, GROUP), [True, False, True, False])


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda r: advantages.group_advantages(r, 3), "group_size=3"),
        (lambda r: advantages.group_advantages(r.reshape(2, 4), 4), r"\(2, 4\)"),
        (lambda r: advantages.group_advantages(r, 4, estimator="ppo"), "'ppo'.*'grpo', 'rloo'"),
        (lambda r: advantages.group_advantages(r, 1, estimator="rloo"), "group_size >= 2"),
        (lambda r: advantages.zero_variance_groups(r, 5), "group_size=5"),
    ],
)
def test_bad_arguments_raise(call, match):
  with pytest.raises(ValueError, match=match):
    call(jnp.arange(8.0))

"""PPO's critic-side pieces against independent numpy float64 references written as loops (values and gradients)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_posttrain.losses import policy_gradient
from maxtext_posttrain.losses import ppo

N, T = 6, 9
# (first column, length) of each row's completion: starts at different columns (left-padded prompts), one fills the
# row, one is a single token, one is empty.
SPANS = [(2, 4), (0, 9), (5, 1), (0, 0), (3, 6), (1, 5)]
CLIP = 0.2


def _mask(spans=SPANS, width=T):
  mask = np.zeros((len(spans), width), np.float32)
  for row, (start, length) in enumerate(spans):
    mask[row, start : start + length] = 1
  return mask


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  mask = _mask()
  scores = rng.normal(size=N).astype(np.float32)
  logps = -rng.uniform(0.1, 4.0, (N, T)).astype(np.float32)
  ref_logps = (logps + rng.normal(0.0, 0.5, (N, T))).astype(np.float32)
  rewards = rng.normal(0.0, 0.3, (N, T)).astype(np.float32)
  values = rng.normal(0.0, 1.0, (N, T)).astype(np.float32)
  return scores, logps, ref_logps, rewards, values, mask


def _garbage(x, mask, fill):
  """x with entries outside the mask replaced by fill, which the functions must ignore."""
  return np.where(mask > 0, x, fill).astype(np.float32)


def _completion_columns(mask_row):
  return [t for t in range(len(mask_row)) if mask_row[t] > 0]


# ---------------------------------------------------------------------------------------------------------- numpy refs


def _numpy_kl(logps, ref_logps, estimator):
  d = float(logps) - float(ref_logps)
  return {"k1": d, "k2": d * d / 2, "k3": np.exp(-d) + d - 1}[estimator]


def _numpy_kl_shaped_rewards(scores, logps, ref_logps, mask, kl_coef, estimator):
  rewards, kl = np.zeros((N, T)), np.zeros((N, T))
  for i in range(N):
    columns = _completion_columns(mask[i])
    for t in columns:
      kl[i, t] = _numpy_kl(logps[i, t], ref_logps[i, t], estimator)
      rewards[i, t] = -kl_coef * kl[i, t]
    if columns:
      rewards[i, columns[-1]] += scores[i]
  return rewards, kl


def _numpy_gae(rewards, values, mask, gamma, lam):
  """Backwards over each row's completion tokens; the value and advantage after the last one are 0."""
  advantages, returns = np.zeros(rewards.shape), np.zeros(rewards.shape)
  for i in range(rewards.shape[0]):
    next_value, next_advantage = 0.0, 0.0
    for t in reversed(_completion_columns(mask[i])):
      delta = float(rewards[i, t]) + gamma * next_value - float(values[i, t])
      advantages[i, t] = delta + gamma * lam * next_advantage
      returns[i, t] = advantages[i, t] + float(values[i, t])
      next_value, next_advantage = float(values[i, t]), advantages[i, t]
  return advantages, returns


def _numpy_whiten(values, mask, shift_mean, eps):
  entries = [float(values[i, t]) for i in range(values.shape[0]) for t in range(values.shape[1]) if mask[i, t] > 0]
  n = len(entries)
  mean = sum(entries) / n
  var = sum((x - mean) ** 2 for x in entries) / (n - 1)  # Bessel's correction, as TRL's masked_var
  out = np.zeros(values.shape)
  for i in range(values.shape[0]):
    for t in range(values.shape[1]):
      if mask[i, t] > 0:
        out[i, t] = (values[i, t] - mean) / np.sqrt(var + eps) + (0.0 if shift_mean else mean)
  return out


def _numpy_aggregate(per_token, mask, mode, max_length):
  """(aggregated value, weight) from each mode's formula."""
  rows = [(sum(per_token[i, t] for t in _completion_columns(mask[i])), mask[i].sum()) for i in range(mask.shape[0])]
  rows = [(total, count) for total, count in rows if count > 0]
  if mode == "token-mean":
    return sum(total for total, _ in rows) / sum(count for _, count in rows), sum(count for _, count in rows)
  if mode == "seq-mean-token-mean":
    per_seq = [total / count for total, count in rows]
  elif mode == "seq-mean-token-sum":
    per_seq = [total for total, _ in rows]
  else:
    per_seq = [total / max_length for total, _ in rows]
  return sum(per_seq) / len(per_seq), len(per_seq)


def _numpy_value_loss(values, old_values, returns, mask, clip_range, agg_mode, max_length):
  """(loss, weight, clip fraction as a mean) in float64."""
  per_token, clipped = np.zeros(values.shape), np.zeros(values.shape)
  for i in range(values.shape[0]):
    for t in _completion_columns(mask[i]):
      v, old, target = float(values[i, t]), float(old_values[i, t]), float(returns[i, t])
      unclipped = (v - target) ** 2
      if clip_range is None or clip_range <= 0:
        per_token[i, t] = 0.5 * unclipped
        continue
      v_clipped = old + min(max(v - old, -clip_range), clip_range)
      per_token[i, t] = 0.5 * max(unclipped, (v_clipped - target) ** 2)
      clipped[i, t] = (v_clipped - target) ** 2 > unclipped
  loss, weight = _numpy_aggregate(per_token, mask, agg_mode, max_length)
  fraction, _ = _numpy_aggregate(clipped, mask, "token-mean" if agg_mode == "token-mean" else "seq-mean-token-mean", 1)
  return loss, weight, fraction


def _central_differences(f, x, mask, h=1e-6):
  """df/dx on the mask's entries; 0 elsewhere."""
  grad = np.zeros_like(x)
  for i in zip(*np.nonzero(mask)):
    step = np.zeros_like(x)
    step[i] = h
    grad[i] = (f(x + step) - f(x - step)) / (2 * h)
  return grad


# -------------------------------------------------------------------------------------------------- kl_shaped_rewards


@pytest.mark.parametrize("estimator", policy_gradient.KL_ESTIMATORS)
def test_kl_shaped_rewards_match_numpy(estimator):
  scores, logps, ref_logps, _, _, mask = _inputs()
  kl_coef = 0.07
  rewards, kl = ppo.kl_shaped_rewards(
      scores, _garbage(logps, mask, np.nan), _garbage(ref_logps, mask, -np.inf), mask, kl_coef, estimator
  )
  ref_rewards, ref_kl = _numpy_kl_shaped_rewards(scores, logps, ref_logps, mask, kl_coef, estimator)
  np.testing.assert_allclose(rewards, ref_rewards, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(kl, ref_kl, rtol=1e-5, atol=1e-6)
  assert rewards.dtype == kl.dtype == jnp.float32


def test_kl_shaped_rewards_put_the_score_on_the_last_completion_token():
  """With no KL the rewards are the scores alone, each on its row's last completion token (a hole does not move it),
  and an empty row gets nothing."""
  mask = _mask([(1, 3), (0, 0), (4, 2)], width=7)
  mask[2, 6] = 1  # completion columns 4, 5, 6 ...
  mask[2, 5] = 0  # ... with a hole at 5: still last at 6
  logps = np.zeros((3, 7), np.float32)
  rewards, kl = ppo.kl_shaped_rewards(np.array([2.0, 5.0, -1.0]), logps, logps, mask, 0.1)
  expected = np.zeros((3, 7))
  expected[0, 3], expected[2, 6] = 2.0, -1.0
  np.testing.assert_array_equal(rewards, expected)
  np.testing.assert_array_equal(kl, 0)


def test_kl_shaped_rewards_carry_no_gradient():
  scores, logps, ref_logps, _, _, mask = _inputs()

  def total(scores, logps, ref_logps, kl_coef):
    rewards, kl = ppo.kl_shaped_rewards(scores, logps, ref_logps, mask, kl_coef, "k3")
    return jnp.sum(rewards) + jnp.sum(kl)

  grads = jax.grad(total, argnums=(0, 1, 2, 3))(jnp.asarray(scores), jnp.asarray(logps), jnp.asarray(ref_logps), 0.1)
  for grad in grads:
    np.testing.assert_array_equal(grad, 0)


# --------------------------------------------------------------------------------------------------------------- gae


def test_gae_by_hand():
  """rewards [0, 0, 1], values [0.5, 0.6, 0.7], gamma 1, lam 0.95; backwards from the terminal value 0:
    t=2: delta = 1 + 0   - 0.7 = 0.3   A = 0.3
    t=1: delta = 0 + 0.7 - 0.6 = 0.1   A = 0.1 + 0.95 * 0.3   = 0.385
    t=0: delta = 0 + 0.6 - 0.5 = 0.1   A = 0.1 + 0.95 * 0.385 = 0.46575
  returns = A + V = [0.96575, 0.985, 1.0]. Row 0 has the completion at columns 1-3, row 1 at columns 3-5 (with
  garbage in the columns outside the mask, which must not leak in)."""
  mask = _mask([(1, 3), (3, 3)], width=6)
  rewards = np.array([[9, 0, 0, 1, 9, 9], [9, 9, 9, 0, 0, 1]], np.float32)
  values = np.array([[9, 0.5, 0.6, 0.7, 9, 9], [9, 9, 9, 0.5, 0.6, 0.7]], np.float32)
  advantages, returns = ppo.gae(rewards, values, mask, gamma=1.0, lam=0.95)
  np.testing.assert_allclose(advantages, [[0, 0.46575, 0.385, 0.3, 0, 0], [0, 0, 0, 0.46575, 0.385, 0.3]], rtol=1e-6)
  np.testing.assert_allclose(returns, [[0, 0.96575, 0.985, 1.0, 0, 0], [0, 0, 0, 0.96575, 0.985, 1.0]], rtol=1e-6)


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
def test_gae_matches_numpy(gamma, lam):
  _, _, _, rewards, values, mask = _inputs()
  advantages, returns = ppo.gae(_garbage(rewards, mask, np.inf), _garbage(values, mask, np.nan), mask, gamma, lam)
  ref_advantages, ref_returns = _numpy_gae(rewards, values, mask, gamma, lam)
  np.testing.assert_allclose(advantages, ref_advantages, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(returns, ref_returns, rtol=1e-5, atol=1e-6)


def test_gae_limits():
  """lam = 1: Monte-Carlo returns (the discounted sum of the rewards to go), minus V; lam = 0: one-step TD errors."""
  _, _, _, rewards, values, mask = _inputs(seed=1)
  gamma = 0.9
  _, returns = ppo.gae(rewards, values, mask, gamma, 1.0)
  td, _ = ppo.gae(rewards, values, mask, gamma, 0.0)
  for i in range(N):
    columns = _completion_columns(mask[i])
    for k, t in enumerate(columns):
      to_go = sum(gamma**j * float(rewards[i, u]) for j, u in enumerate(columns[k:]))
      np.testing.assert_allclose(returns[i, t], to_go, rtol=1e-5, atol=1e-6)
      next_value = float(values[i, columns[k + 1]]) if k + 1 < len(columns) else 0.0
      np.testing.assert_allclose(td[i, t], rewards[i, t] + gamma * next_value - values[i, t], rtol=1e-5, atol=1e-6)


def test_gae_steps_over_holes_in_the_mask():
  """A hole (tokens the policy did not choose, e.g. tool output) is skipped: the tokens either side of it are
  consecutive steps, and the hole's own rewards and values play no part."""
  mask = _mask([(1, 5)], width=7)
  mask[0, 3] = 0
  rewards = np.array([[0, 0.1, 0.2, 50.0, 0.3, 1.0, 0]], np.float32)
  values = np.array([[0, 0.4, 0.3, 50.0, 0.2, 0.1, 0]], np.float32)
  advantages, returns = ppo.gae(rewards, values, mask, 0.95, 0.9)
  ref_advantages, ref_returns = _numpy_gae(rewards, values, mask, 0.95, 0.9)
  np.testing.assert_allclose(advantages, ref_advantages, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(returns, ref_returns, rtol=1e-6, atol=1e-7)
  compact, _ = ppo.gae(rewards[:, [1, 2, 4, 5]], values[:, [1, 2, 4, 5]], np.ones((1, 4)), 0.95, 0.9)
  np.testing.assert_allclose(advantages[:, [1, 2, 4, 5]], compact, rtol=1e-6)


def test_gae_has_no_gradient():
  _, _, _, rewards, values, mask = _inputs()

  def total(rewards, values):
    advantages, returns = ppo.gae(rewards, values, mask)
    return jnp.sum(advantages) + jnp.sum(returns)

  for grad in jax.grad(total, argnums=(0, 1))(jnp.asarray(rewards), jnp.asarray(values)):
    np.testing.assert_array_equal(grad, 0)


def test_gae_rows_are_independent_and_jit():
  """Each row is its own episode: splitting the batch changes nothing, jitted or not."""
  _, _, _, rewards, values, mask = _inputs(seed=2)
  whole = jax.jit(ppo.gae)(rewards, values, mask)
  halves = [ppo.gae(rewards[rows], values[rows], mask[rows]) for rows in (slice(0, 2), slice(2, N))]
  for k in range(2):
    np.testing.assert_allclose(np.concatenate([h[k] for h in halves]), whole[k], rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------------------------------ whiten


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_matches_numpy(shift_mean):
  _, _, _, _, values, mask = _inputs()
  values = 3.0 * values + 1.5
  got = ppo.whiten(_garbage(values, mask, np.nan), mask, shift_mean=shift_mean)
  np.testing.assert_allclose(got, _numpy_whiten(values, mask, shift_mean, 1e-8), rtol=1e-5, atol=1e-5)
  entries = np.asarray(got)[mask > 0].astype(np.float64)
  np.testing.assert_allclose(entries.mean(), 0.0 if shift_mean else values[mask > 0].mean(), atol=1e-5)
  np.testing.assert_allclose(entries.std(ddof=1), 1.0, rtol=1e-5)
  assert np.all(np.asarray(got)[mask == 0] == 0)


def test_whiten_degenerate_masks():
  """Constant values whiten to 0 (eps keeps it finite), as does a single entry; an empty mask gives all zeros."""
  mask = _mask([(1, 3), (0, 0)], width=5)
  np.testing.assert_array_equal(ppo.whiten(np.full((2, 5), 4.0), mask), 0)
  np.testing.assert_allclose(ppo.whiten(np.full((2, 5), 4.0), mask, shift_mean=False), 4.0 * mask)
  np.testing.assert_array_equal(ppo.whiten(np.arange(10.0).reshape(2, 5), _mask([(2, 1), (0, 0)], width=5)), 0)
  np.testing.assert_array_equal(ppo.whiten(np.arange(10.0).reshape(2, 5), np.zeros((2, 5))), 0)


# -------------------------------------------------------------------------------------------------------- value_loss


def _value_inputs(seed=3):
  """Values on both sides of the clip range (moved 0.05 to 0.6 from old_values), the kinks well avoided."""
  rng = np.random.default_rng(seed)
  mask = _mask()
  old_values = rng.normal(size=(N, T))
  returns = old_values + rng.normal(0.0, 0.5, (N, T))
  moves = rng.uniform(0.05, 0.6, (N, T)) * rng.choice([-1.0, 1.0], (N, T))
  moves[np.abs(np.abs(moves) - CLIP) < 0.02] += 0.05
  values = old_values + moves
  return values.astype(np.float32), old_values.astype(np.float32), returns.astype(np.float32), mask


def test_value_inputs_take_both_branches_away_from_the_kinks():
  values, old_values, returns, mask = _value_inputs()
  on = mask > 0
  v_clipped = old_values + np.clip(values - old_values, -CLIP, CLIP)
  clipped, unclipped = (v_clipped - returns) ** 2, (values - returns) ** 2
  assert np.min(np.abs(np.abs(values - old_values) - CLIP)[on]) > 1e-3
  moved = on & (np.abs(values - old_values) > CLIP)
  assert np.min(np.abs(clipped - unclipped)[moved]) > 1e-3
  assert np.any((clipped > unclipped)[on]) and np.any((clipped < unclipped)[moved])


@pytest.mark.parametrize("clip_range", [CLIP, None, 0.0])
@pytest.mark.parametrize("agg", policy_gradient.AGG_MODES)
def test_value_loss_matches_numpy(agg, clip_range):
  values, old_values, returns, mask = _value_inputs()
  max_length = T + 2

  def loss(values):
    out = ppo.value_loss(
        values, _garbage(old_values, mask, np.nan), _garbage(returns, mask, np.inf), mask, clip_range, agg, max_length
    )
    return out.total / out.weight, out

  (value, out), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(_garbage(values, mask, np.nan)))
  ref, ref_weight, ref_fraction = _numpy_value_loss(values, old_values, returns, mask, clip_range, agg, max_length)
  assert isinstance(out, ppo.ValueLoss)
  np.testing.assert_allclose(value, ref, rtol=1e-5)
  np.testing.assert_allclose(out.weight, ref_weight)
  np.testing.assert_allclose(out.metrics["vf_clip_fraction"] / out.weight, ref_fraction, rtol=1e-6)
  assert (ref_fraction > 0) == (clip_range == CLIP)

  anchor = values.astype(np.float64)
  ref_grad = _central_differences(
      lambda x: _numpy_value_loss(x, old_values, returns, mask, clip_range, agg, max_length)[0], anchor, mask
  )
  np.testing.assert_allclose(grad, ref_grad, rtol=1e-3, atol=1e-6)
  assert np.all(np.asarray(grad)[mask == 0] == 0)


def test_value_clipping_by_hand():
  """old 0, returns 1, clip 0.2, one token per row:
  v = 0.5:  v_clipped = 0.2, (0.2 - 1)^2 = 0.64 > (0.5 - 1)^2 = 0.25: clipped, loss 0.32, no gradient
  v = 1.5:  v_clipped = 0.2, 0.64 > 0.25: clipped (the critic overshot), loss 0.32, no gradient
  v = 0.1:  inside the range, v_clipped = v: not clipped, loss 0.405, gradient v - 1 = -0.9
  v = -0.5: v_clipped = -0.2, 1.44 < 2.25: the unclipped term is the larger, loss 1.125, gradient -1.5
  Unclipped (clip_range None), every row has loss 0.5 (v - 1)^2 and gradient v - 1.
  """
  values = jnp.array([[0.5], [1.5], [0.1], [-0.5]])
  zeros, ones = np.zeros((4, 1)), np.ones((4, 1))

  def loss(values, clip_range):
    out = ppo.value_loss(values, zeros, ones, ones, clip_range, "seq-mean-token-sum")
    return out.total, out

  (total, out), grad = jax.value_and_grad(loss, has_aux=True)(values, 0.2)
  np.testing.assert_allclose(total, 0.32 + 0.32 + 0.405 + 1.125, rtol=1e-6)
  np.testing.assert_allclose(grad, [[0.0], [0.0], [-0.9], [-1.5]], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(out.metrics["vf_clip_fraction"], 2.0)
  np.testing.assert_allclose(out.weight, 4.0)

  (total, out), grad = jax.value_and_grad(loss, has_aux=True)(values, None)
  np.testing.assert_allclose(total, 0.5 * (0.25 + 0.25 + 0.81 + 2.25), rtol=1e-6)
  np.testing.assert_allclose(grad, [[-0.5], [0.5], [-0.9], [-1.5]], rtol=1e-6)
  assert out.metrics["vf_clip_fraction"] == 0


@pytest.mark.parametrize("agg", policy_gradient.AGG_MODES)
def test_value_loss_microbatches_add_up_to_the_batch(agg):
  values, old_values, returns, mask = _value_inputs(seed=4)
  batch = ppo.value_loss(values, old_values, returns, mask, CLIP, agg, max_length=11)
  halves = [
      ppo.value_loss(values[rows], old_values[rows], returns[rows], mask[rows], CLIP, agg, max_length=11)
      for rows in (slice(0, 3), slice(3, N))
  ]
  np.testing.assert_allclose(sum(h.total for h in halves), batch.total, rtol=1e-6)
  np.testing.assert_allclose(sum(h.weight for h in halves), batch.weight)
  np.testing.assert_allclose(
      sum(h.metrics["vf_clip_fraction"] for h in halves), batch.metrics["vf_clip_fraction"], rtol=1e-6
  )


def test_value_loss_is_a_pytree_under_jit():
  values, old_values, returns, mask = _value_inputs()
  jitted = jax.jit(ppo.value_loss, static_argnames=("clip_range", "agg_mode", "max_length"))(
      values, old_values, returns, mask, clip_range=CLIP
  )
  eager = ppo.value_loss(values, old_values, returns, mask, CLIP)
  assert isinstance(jitted, ppo.ValueLoss)
  for a, b in zip(jax.tree_util.tree_leaves(jitted), jax.tree_util.tree_leaves(eager)):
    np.testing.assert_allclose(a, b, rtol=1e-6)


# ------------------------------------------------------------------------------------------------ explained_variance


def _numpy_explained_variance(values, returns, mask):
  residuals = [float(returns[i, t] - values[i, t]) for i in range(N) for t in _completion_columns(mask[i])]
  targets = [float(returns[i, t]) for i in range(N) for t in _completion_columns(mask[i])]
  return 1.0 - np.var(residuals) / np.var(targets)


def test_explained_variance():
  _, _, _, noise, returns, mask = _inputs(seed=5)  # returns of std 1, a critic off by noise of std 0.3
  noisy = returns + noise
  got = ppo.explained_variance(_garbage(noisy, mask, np.nan), _garbage(returns, mask, np.inf), mask)
  np.testing.assert_allclose(got, _numpy_explained_variance(noisy, returns, mask), rtol=1e-5)
  assert 0 < got < 1
  np.testing.assert_allclose(ppo.explained_variance(returns, returns, mask), 1.0)  # a perfect critic
  for constant in (np.mean(returns[mask > 0]), 3.0):  # any constant: Var[returns - c] = Var[returns]
    np.testing.assert_allclose(ppo.explained_variance(np.full((N, T), constant), returns, mask), 0.0, atol=1e-5)
  assert ppo.explained_variance(-returns, returns, mask) < 0  # worse than the mean


def test_explained_variance_is_zero_where_the_returns_do_not_vary():
  mask = _mask()
  assert ppo.explained_variance(np.arange(N * T, dtype=np.float32).reshape(N, T), np.ones((N, T)), mask) == 0.0
  assert ppo.explained_variance(np.ones((N, T)), np.arange(N * T, dtype=np.float32).reshape(N, T), 0 * mask) == 0.0


# ------------------------------------------------------------------------------------------------------ KL controllers


def test_adaptive_kl_controller_matches_a_numpy_loop_and_round_trips():
  init, target, horizon = 0.2, 6.0, 10_000
  observed = [(9.0, 256), (8.0, 256), (6.3, 512), (1.0, 256), (5.9, 128), (np.float32(40.0), 256), (0.0, 64)]
  value, expected = init, []
  for kl, n_steps in observed:
    value *= 1 + np.clip(float(kl) / target - 1, -0.2, 0.2) * n_steps / horizon
    expected.append(value)

  controller = ppo.AdaptiveKLController(init, target, horizon)
  got = [controller.update(kl, n) for kl, n in observed[:4]]
  restored = ppo.AdaptiveKLController(init, target, horizon)
  restored.load_state_dict(json.loads(json.dumps(controller.state_dict())))
  assert restored.value == controller.value
  got += [restored.update(kl, n) for kl, n in observed[4:]]
  np.testing.assert_allclose(got, expected, rtol=1e-12)
  assert restored.value == got[-1] and isinstance(restored.value, float)
  # Clipped at +-20%: far above the target, a full horizon multiplies by 1.2; at zero KL, by 0.8.
  for kl, factor in ((100.0, 1.2), (0.0, 0.8)):
    controller = ppo.AdaptiveKLController(0.1, target, horizon)
    np.testing.assert_allclose(controller.update(kl, horizon), 0.1 * factor, rtol=1e-12)


def test_fixed_kl_controller():
  controller = ppo.FixedKLController(0.05)
  assert controller.update(100.0, 1000) == 0.05 == controller.value
  restored = ppo.FixedKLController(0.3)
  restored.load_state_dict(json.loads(json.dumps(controller.state_dict())))
  assert restored.value == 0.05


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: ppo.AdaptiveKLController(0.1, 0.0, 100), "target > 0"),
        (lambda: ppo.AdaptiveKLController(-0.1, 6.0, 100), "init_kl_coef >= 0"),
        (lambda: ppo.AdaptiveKLController(0.1, 6.0, 0), "horizon > 0"),
        (lambda: ppo.AdaptiveKLController(0.1, 6.0, 100).update(float("nan"), 8), "current_kl must be finite"),
        (lambda: ppo.FixedKLController(-1.0), "kl_coef must be >= 0"),
    ],
)
def test_kl_controllers_reject_bad_arguments(make, match):
  with pytest.raises(ValueError, match=match):
    make()


# ------------------------------------------------------------------------------------------------------- bad shapes


def test_bad_arguments_raise():
  x, mask = np.zeros((N, T)), np.ones((N, T))
  with pytest.raises(ValueError, match=r"scores \(7,\)"):
    ppo.kl_shaped_rewards(np.zeros(N + 1), x, x, mask, 0.1)
  with pytest.raises(ValueError, match="kl_estimator 'k4'"):
    ppo.kl_shaped_rewards(np.zeros(N), x, x, mask, 0.1, "k4")
  with pytest.raises(ValueError, match=r"values \(6, 8\)"):
    ppo.gae(x, np.zeros((N, T - 1)), mask)
  with pytest.raises(ValueError, match=r"mask \(9,\)"):
    ppo.whiten(x, np.ones(T))
  with pytest.raises(ValueError, match="agg_mode 'mean'"):
    ppo.value_loss(x, x, x, mask, CLIP, "mean")
  with pytest.raises(ValueError, match=r"returns \(6, 1\)"):
    ppo.explained_variance(x, np.zeros((N, 1)), mask)

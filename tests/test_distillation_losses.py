"""The distillation losses against independent numpy float64 references (values and gradients)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_posttrain.losses import distillation
from maxtext_posttrain.losses import logprobs

B, T, V = 3, 5, 11
K = 3  # kept ids of a sparse teacher
# (divergence, beta): every divergence, and the JSD at both ends and in between.
CASES = [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.0), ("jsd", 0.3), ("jsd", 0.5), ("jsd", 1.0)]
# The sparse form shares the divergences' code, JSD ends included: each kind once.
SPARSE_CASES = [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3)]


def _mask():
  mask = np.ones((B, T), np.float32)
  mask[0, 3:] = 0  # padding
  mask[2, 0] = 0
  mask[1, 2] = 0.5  # a weighted token
  return mask


def _logits(seed=0):
  """Student and teacher logits [B, T, V]; some tokens very peaked (logits of order 100) on one side or both."""
  rng = np.random.default_rng(seed)
  student = rng.normal(0.0, 2.0, (B, T, V))
  teacher = rng.normal(0.0, 2.0, (B, T, V))
  teacher[0, 1] *= 40.0
  student[1, 0] *= 40.0
  teacher[2, 3] *= 30.0
  student[2, 3] *= 30.0
  return student.astype(np.float32), teacher.astype(np.float32)


def _garbage(x, mask, fill):
  """x with the tokens outside the mask filled with a value the losses must ignore."""
  return np.where((mask > 0).reshape(mask.shape + (1,) * (x.ndim - mask.ndim)), x, fill).astype(x.dtype)


# ---------------------------------------------------------------------------------------------------------- numpy refs


def _log_softmax(x):
  x = np.asarray(x, np.float64)
  top = x.max(axis=-1, keepdims=True)
  return x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True))


def _numpy_divergence(lp, lq, divergence, beta):
  """(divergence, h) for log-probs over buckets on the last axis, with h = q * dD/dq, the gradient in log q."""
  p, q = np.exp(lp), np.exp(lq)
  if divergence == "jsd" and beta == 0.0:
    divergence = "forward_kl"
  if divergence == "jsd" and beta == 1.0:
    divergence = "reverse_kl"

  def kl(a, la, lb):  # 0 log 0 = 0
    with np.errstate(invalid="ignore"):
      return np.sum(np.where(a > 0, a * (la - lb), 0.0), axis=-1)

  if divergence == "forward_kl":  # sum p log(p / q);  dD/dq = -p / q
    return kl(p, lp, lq), -p
  if divergence == "reverse_kl":  # sum q log(q / p);  dD/dq = log(q / p) + 1
    return kl(q, lq, lp), q * (lq - lp + 1.0)
  # beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q;  dD/dq = (1 - beta) log(q / m)
  lm = np.logaddexp(math.log(beta) + lp, math.log(1.0 - beta) + lq)
  return beta * kl(p, lp, lm) + (1.0 - beta) * kl(q, lq, lm), (1.0 - beta) * q * (lq - lm)


def _numpy_logit_loss(student, teacher, mask, divergence, beta, temperature):
  """(loss, divergence at T / weight, d loss / d student logits) with loss = T^2 sum mask * D / sum mask.

  Through the softmax, dD/dz_v = (h_v - q_v sum h) / T for h = q * dD/dq.
  """
  lq, lp = _log_softmax(np.asarray(student, np.float64) / temperature), _log_softmax(np.asarray(teacher) / temperature)
  per_token, h = _numpy_divergence(lp, lq, divergence, beta)
  weight = mask.sum()
  grad_z = (h - np.exp(lq) * h.sum(axis=-1, keepdims=True)) / temperature
  on = mask > 0
  divergence_sum = np.sum(np.where(on, mask * per_token, 0.0))
  grad = temperature**2 * np.where(on[..., None], mask[..., None] * grad_z, 0.0) / weight
  return temperature**2 * divergence_sum / weight, divergence_sum / weight, grad


def _numpy_top_k(teacher, k, temperature):
  """(ids, log-probs, log of the tail's mass), the tail summed over its own terms in float64."""
  lp = _log_softmax(np.asarray(teacher, np.float64) / temperature)
  ids = np.argsort(-np.asarray(teacher), axis=-1, kind="stable")[..., :k]
  tail = np.ones(lp.shape, bool)
  np.put_along_axis(tail, ids, False, axis=-1)
  with np.errstate(divide="ignore"):
    log_rest = np.log(np.sum(np.where(tail, np.exp(lp), 0.0), axis=-1))
  return ids, np.take_along_axis(lp, ids, axis=-1), log_rest


def _numpy_sparse_loss(student, ids, teacher_lp, teacher_log_rest, mask, divergence, beta, temperature):
  """As `_numpy_logit_loss` over k + 1 buckets: the ids and the rest. With Q_b the student's mass of bucket b,
  dD/dz_v = (q_v / Q_b(v) * h_b(v) - q_v sum h) / T."""
  lq_full = _log_softmax(np.asarray(student, np.float64) / temperature)
  q_full = np.exp(lq_full)
  tail = np.ones(q_full.shape, bool)
  np.put_along_axis(tail, ids, False, axis=-1)
  with np.errstate(divide="ignore"):
    lq_rest = np.log(np.sum(np.where(tail, q_full, 0.0), axis=-1))
  lq = np.concatenate([np.take_along_axis(lq_full, ids, axis=-1), lq_rest[..., None]], axis=-1)
  lp = np.concatenate([np.asarray(teacher_lp, np.float64), np.asarray(teacher_log_rest, np.float64)[..., None]], -1)
  per_token, h = _numpy_divergence(lp, lq, divergence, beta)
  share = np.where(tail, np.exp(lq_full - np.where(np.isfinite(lq_rest), lq_rest, 0.0)[..., None]), 0.0) * h[..., -1:]
  top_share = np.zeros(q_full.shape)
  np.put_along_axis(top_share, ids, h[..., :-1], axis=-1)
  grad_z = (share + top_share - q_full * h.sum(axis=-1, keepdims=True)) / temperature
  on = mask > 0
  weight = mask.sum()
  loss = temperature**2 * np.sum(np.where(on, mask * per_token, 0.0)) / weight
  return loss, temperature**2 * np.where(on[..., None], mask[..., None] * grad_z, 0.0) / weight


def _loss_and_grad(fn, student, *args, frozen=()):
  """(loss, the DistillationLoss, d loss / d student) of fn(student, *args), checking that the arguments at the
  indices `frozen` (the teacher's) get no gradient: the losses stop it themselves."""
  argnums = tuple(range(1 + len(frozen)))

  def loss(student, *teacher):
    full = list(args)
    for i, x in zip(frozen, teacher):
      full[i] = x
    out = fn(student, *full)
    return out.total / out.weight, out

  (value, out), grads = jax.value_and_grad(loss, argnums, has_aux=True)(
      jnp.asarray(student), *(jnp.asarray(args[i]) for i in frozen)
  )
  for grad in grads[1:]:
    np.testing.assert_array_equal(grad, 0)
  return value, out, grads[0]


# -------------------------------------------------------------------------------------------------------- dense logits


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("divergence,beta", CASES)
def test_logit_loss_matches_numpy(divergence, beta, temperature):
  student, teacher = _logits()
  mask = _mask()
  value, out, grad = _loss_and_grad(
      distillation.logit_loss,
      _garbage(student, mask, np.nan),
      _garbage(teacher, mask, np.inf),
      mask,
      divergence,
      temperature,
      beta,
      frozen=(0,),
  )
  ref, ref_divergence, ref_grad = _numpy_logit_loss(student, teacher, mask, divergence, beta, temperature)
  assert isinstance(out, distillation.DistillationLoss)
  np.testing.assert_allclose(value, ref, rtol=1e-5)
  np.testing.assert_allclose(out.weight, mask.sum())
  np.testing.assert_allclose(out.metrics["divergence"] / out.weight, ref_divergence, rtol=1e-5)
  agree = (np.argmax(student, -1) == np.argmax(teacher, -1)) * mask
  np.testing.assert_allclose(out.metrics["top1_agreement"], agree.sum())
  np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-6)
  assert np.all(np.asarray(grad)[mask == 0] == 0)


def test_jsd_ends_are_the_two_kls_and_its_limits():
  """beta 0 and 1 are exactly the forward and the reverse KL; near them JSD_beta / beta -> KL(p || q) and
  JSD_beta / (1 - beta) -> KL(q || p), so the ends are the limits' shapes (TRL's generalized_jsd_loss convention)."""
  rng = np.random.default_rng(1)  # not peaked: the limits come slowly where p / q is large
  student, teacher = rng.normal(0.0, 1.0, (2, B, T, V)).astype(np.float32)

  def per_token(divergence, beta=0.5):
    return np.asarray(distillation.token_divergence(student, teacher, divergence, beta=beta), np.float64)

  forward, reverse = per_token("forward_kl"), per_token("reverse_kl")
  np.testing.assert_array_equal(per_token("jsd", 0.0), forward)
  np.testing.assert_array_equal(per_token("jsd", 1.0), reverse)
  np.testing.assert_allclose(per_token("jsd", 1e-3) / 1e-3, forward, rtol=2e-2)
  np.testing.assert_allclose(per_token("jsd", 1.0 - 1e-3) / 1e-3, reverse, rtol=2e-2)
  assert not np.allclose(forward, reverse, rtol=0.1)
  assert np.all(per_token("jsd", 0.5) <= math.log(2) + 1e-6)


@pytest.mark.parametrize("divergence,beta", CASES)
def test_temperature_scaling_is_t_squared(divergence, beta):
  """At T = 2 the loss is 4 times the divergence of the halved logits at T = 1, as MaxText's soft loss."""
  student, teacher = _logits(seed=2)
  mask = _mask()
  at_2 = distillation.logit_loss(student, teacher, mask, divergence, 2.0, beta)
  at_1 = distillation.logit_loss(student / 2, teacher / 2, mask, divergence, 1.0, beta)
  np.testing.assert_allclose(at_2.total, 4.0 * at_2.metrics["divergence"], rtol=1e-6)
  np.testing.assert_allclose(at_2.metrics["divergence"], at_1.total, rtol=1e-5)
  np.testing.assert_allclose(at_2.total, 4.0 * at_1.total, rtol=1e-5)


def test_a_student_equal_to_its_teacher_has_no_loss():
  student, _ = _logits(seed=3)
  for divergence, beta in CASES:
    value, _, grad = _loss_and_grad(distillation.logit_loss, student, student, _mask(), divergence, 1.5, beta)
    np.testing.assert_allclose(value, 0.0, atol=1e-5)
    np.testing.assert_allclose(grad, 0.0, atol=1e-6)


def test_padded_vocabulary_takes_no_part():
  """Logits masked by `logprobs.mask_undecodable` on both sides give the loss of the unpadded vocabulary."""
  student, teacher = _logits(seed=5)
  padded_s = np.concatenate([student, np.full((B, T, 3), 7.0, np.float32)], -1)
  padded_t = np.concatenate([teacher, np.full((B, T, 3), -2.0, np.float32)], -1)
  for divergence, beta in SPARSE_CASES:
    value, _, grad = _loss_and_grad(distillation.logit_loss, student, teacher, _mask(), divergence, 2.0, beta)
    padded_value, _, padded_grad = _loss_and_grad(
        lambda s, *a: distillation.logit_loss(logprobs.mask_undecodable(s, V), *a),
        padded_s,
        logprobs.mask_undecodable(padded_t, V),
        _mask(),
        divergence,
        2.0,
        beta,
    )
    np.testing.assert_allclose(padded_value, value, rtol=1e-6)
    np.testing.assert_allclose(padded_grad[..., :V], grad, rtol=1e-5, atol=1e-8)
    np.testing.assert_array_equal(padded_grad[..., V:], 0)


def test_logit_loss_microbatches_add_up_and_jit():
  """Two microbatches (here the batch's tokens split by mask) add up to the batch, jitted or not."""
  student, teacher = _logits(seed=6)
  mask = _mask()
  jitted = jax.jit(distillation.logit_loss, static_argnames=("divergence", "beta"))
  batch = jitted(student, teacher, mask, divergence="jsd", temperature=jnp.float32(2.0), beta=0.3)
  eager = distillation.logit_loss(student, teacher, mask, "jsd", 2.0, 0.3)
  first = np.arange(B)[:, None] < 1
  parts = [
      distillation.logit_loss(student, teacher, np.where(rows, mask, 0), "jsd", 2.0, 0.3) for rows in (first, ~first)
  ]
  assert isinstance(batch, distillation.DistillationLoss)
  for a, b, *split in zip(*(jax.tree_util.tree_leaves(x) for x in (batch, eager, *parts))):
    np.testing.assert_allclose(a, b, rtol=1e-6)
    np.testing.assert_allclose(sum(split), a, rtol=1e-6)


# ------------------------------------------------------------------------------------------------------------- top-k


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_teacher_top_k_matches_numpy(temperature):
  _, teacher = _logits(seed=7)
  ids, lp, rest = distillation.teacher_top_k(teacher, K, temperature)
  ref_ids, ref_lp, ref_rest = _numpy_top_k(teacher, K, temperature)
  np.testing.assert_array_equal(ids, ref_ids)
  assert ids.dtype == jnp.int32
  np.testing.assert_allclose(lp, ref_lp, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(rest, ref_rest, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.exp(np.asarray(lp, np.float64)).sum(-1) + np.exp(rest), 1.0, rtol=1e-5)
  _, _, full_rest = distillation.teacher_top_k(teacher, V, temperature)
  assert np.all(np.asarray(full_rest) == -np.inf)
  grad = jax.grad(lambda t: sum(jnp.sum(x) for x in distillation.teacher_top_k(t, K, temperature)[1:]))(teacher)
  np.testing.assert_array_equal(grad, 0)  # the teacher is frozen


def test_teacher_top_k_keeps_a_tiny_rest():
  """A tail of mass ~4e-13 comes back to float32 precision, where 1 - sum of the top-k probabilities is all rounding."""
  logits = np.zeros((1, V), np.float32)
  logits[0, :2] = 30.0  # the other 9 ids share 9 e^-30 / (2 + 9 e^-30) ~ 4.2e-13
  _, lp, rest = distillation.teacher_top_k(logits, 2)
  _, _, ref_rest = _numpy_top_k(logits, 2, 1.0)
  np.testing.assert_allclose(rest, ref_rest, rtol=1e-6)
  assert abs(1.0 - np.exp(np.asarray(lp)).sum()) > 1e3 * np.exp(ref_rest[0])


@pytest.mark.parametrize("divergence,beta", SPARSE_CASES)
def test_sparse_with_the_whole_vocabulary_is_dense(divergence, beta):
  """k = V (ids in a shuffled order, the rest empty) gives the dense loss, values and gradients."""
  temperature = 2.0
  student, teacher = _logits(seed=8)
  mask = _mask()
  ids, lp, rest = distillation.teacher_top_k(teacher, V, temperature)
  order = np.random.default_rng(8).permutation(V)
  ids, lp = np.asarray(ids)[..., order], np.asarray(lp)[..., order]
  value, out, grad = _loss_and_grad(
      distillation.sparse_logit_loss,
      _garbage(student, mask, np.nan),
      _garbage(ids, mask, -5),
      _garbage(lp, mask, np.nan),
      rest,
      mask,
      divergence,
      temperature,
      beta,
      frozen=(1, 2),
  )
  dense_value, dense, dense_grad = _loss_and_grad(
      distillation.logit_loss, student, teacher, mask, divergence, temperature, beta
  )
  np.testing.assert_allclose(value, dense_value, rtol=1e-5)
  np.testing.assert_allclose(grad, dense_grad, rtol=1e-4, atol=1e-6)
  for key in ("divergence", "top1_agreement"):
    np.testing.assert_allclose(out.metrics[key], dense.metrics[key], rtol=1e-5)


@pytest.mark.parametrize("divergence,beta", SPARSE_CASES)
def test_sparse_logit_loss_matches_numpy(divergence, beta):
  temperature = 2.0
  student, teacher = _logits(seed=9)
  mask = _mask()
  ids, lp, rest = _numpy_top_k(teacher, K, temperature)
  value, out, grad = _loss_and_grad(
      distillation.sparse_logit_loss,
      _garbage(student, mask, np.nan),
      ids,
      lp.astype(np.float32),
      rest.astype(np.float32),
      mask,
      divergence,
      temperature,
      beta,
      frozen=(1, 2),
  )
  ref, ref_grad = _numpy_sparse_loss(student, ids, lp, rest, mask, divergence, beta, temperature)
  np.testing.assert_allclose(value, ref, rtol=1e-5)
  np.testing.assert_allclose(out.total, temperature**2 * out.metrics["divergence"], rtol=1e-6)
  agree = (np.argmax(student, -1) == ids[..., 0]) * mask
  np.testing.assert_allclose(out.metrics["top1_agreement"], agree.sum())
  np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("divergence,beta", [("forward_kl", 0.5), ("jsd", 0.3)])
def test_sparse_with_an_empty_rest(divergence, beta):
  """A teacher given as raw top-k logits alone (MaxText's offline file), renormalised, with a log-rest of -inf: its
  tail counts as empty, the student's tail is still a bucket, and everything stays finite. (Not the reverse KL,
  which is infinite wherever the student has mass the teacher has none.)"""
  student, teacher = _logits(seed=10)
  mask = _mask()
  ids = np.argsort(-teacher, axis=-1)[..., :K]
  lp = _log_softmax(np.take_along_axis(teacher, ids, -1) / 2.0)
  rest = np.full((B, T), -np.inf, np.float32)
  value, _, grad = _loss_and_grad(
      distillation.sparse_logit_loss, student, ids, lp.astype(np.float32), rest, mask, divergence, 2.0, beta
  )
  ref, ref_grad = _numpy_sparse_loss(student, ids, lp, rest, mask, divergence, beta, 2.0)
  np.testing.assert_allclose(value, ref, rtol=1e-5)
  np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------- features


def _numpy_feature_loss(student, teacher, mask, loss_type):
  """(loss, d loss / d student) over [L, B, T, D] features and a [B, T] mask, each token once per layer."""
  a, b = np.asarray(student, np.float64), np.asarray(teacher, np.float64)
  weights = np.broadcast_to(mask, a.shape[:-1])
  if loss_type == "l2":
    per_token, grad = np.mean((a - b) ** 2, -1), 2 * (a - b) / a.shape[-1]
  else:  # 1 - a.b / (|a| |b|), each norm floored at sqrt(1e-6) as optax's epsilon
    na = np.sqrt(np.maximum((a * a).sum(-1, keepdims=True), 1e-6))
    nb = np.sqrt(np.maximum((b * b).sum(-1, keepdims=True), 1e-6))
    dot = (a * b).sum(-1, keepdims=True)
    per_token = 1.0 - (dot / (na * nb))[..., 0]
    grad = -(b / (na * nb) - dot * a / (na**3 * nb))
  weight = weights.sum()
  return np.sum(weights * per_token) / weight, weights[..., None] * grad / weight


@pytest.mark.parametrize("loss_type", distillation.FEATURE_LOSSES)
def test_feature_loss_matches_numpy(loss_type):
  rng = np.random.default_rng(11)
  layers, width = 2, 6
  teacher = rng.normal(0.0, 3.0, (layers, B, T, width)).astype(np.float32)
  student = (0.7 * teacher + rng.normal(0.0, 2.0, teacher.shape)).astype(np.float32)
  student[1, 2, 4] *= 1e3  # a large activation
  student[0, 1, 1] = 0.0  # a zero vector: cosine 0 with anything (MaxText's epsilon), not 0/0
  mask = (_mask() > 0).astype(np.float32)
  value, out, grad = _loss_and_grad(
      distillation.feature_loss,
      _garbage(student, mask[None], np.nan),
      _garbage(teacher, mask[None], np.inf),
      mask,
      loss_type,
      frozen=(0,),
  )
  ref, ref_grad = _numpy_feature_loss(student, teacher, mask, loss_type)
  np.testing.assert_allclose(value, ref, rtol=1e-5)
  np.testing.assert_allclose(out.weight, layers * mask.sum())  # MaxText's sum(mask) * L
  np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-9)


# ---------------------------------------------------------------------------------------------------------- attention


def _attention(student_heads, teacher_heads, seed=12, length=T):
  """Causal attention probabilities [B, H, Tq, Tk], some rows very peaked, and a [B, Tq] mask. The student's head 0
  puts exactly 0 on key 0 of the last query, as an underflowed softmax would."""
  rng = np.random.default_rng(seed)
  causal = np.tril(np.ones((length, length), bool))

  def probs(heads, scale):
    scores = rng.normal(0.0, scale, (B, heads, length, length))
    scores[:, 0, -1] *= 20.0
    scores = np.where(causal, scores, -np.inf)
    return np.exp(_log_softmax(scores)).astype(np.float32)

  student = probs(student_heads, 1.5)
  student[:, 0, -1, 0] = 0.0
  student[:, 0, -1] /= student[:, 0, -1].sum(-1, keepdims=True)
  return student, probs(teacher_heads, 2.0), _mask()


TINY = float(np.finfo(np.float32).tiny)


def _numpy_group(x, groups):
  b, h, tq, tk = x.shape
  return x.reshape(b, groups, h // groups, tq, tk).mean(2)


def _numpy_attention_loss(student, teacher, mask, loss_type):
  """(loss, d loss / d student), map by map in float64; the gradient of a group mean is shared by its heads."""
  hs, ht = student.shape[1], teacher.shape[1]
  groups = min(hs, ht) if max(hs, ht) % min(hs, ht) == 0 else 1
  s, t = _numpy_group(np.asarray(student, np.float64), groups), _numpy_group(np.asarray(teacher, np.float64), groups)
  per_map, grad = np.zeros(s.shape[:-1]), np.zeros(s.shape)
  for index in np.ndindex(*s.shape[:-1]):
    q, p = s[index], t[index]
    if loss_type == "kl":  # with q floored at float32's smallest normal, where it has no gradient
      nz, floored = p > 0, np.maximum(q, TINY)
      per_map[index] = np.sum(p[nz] * np.log(p[nz] / floored[nz]))
      grad[index] = np.where(q >= TINY, -p / floored, 0.0)
    elif loss_type == "mse":
      per_map[index] = np.mean((q - p) ** 2)
      grad[index] = 2 * (q - p) / q.size
    else:
      nq, np_ = np.linalg.norm(q), np.linalg.norm(p)
      per_map[index] = 1 - q @ p / (nq * np_)
      grad[index] = -(p / (nq * np_) - (q @ p) * q / (nq**3 * np_))
  weight = mask.sum()
  loss = np.sum(mask * per_map.mean(1)) / weight
  grad = grad * mask[:, None, :, None] / groups / weight  # d/d grouped map, through the mean over groups
  return loss, np.repeat(grad, hs // groups, axis=1) / (hs // groups)


@pytest.mark.parametrize(
    "heads,loss_type",
    [*(((2, 4), loss_type) for loss_type in distillation.ATTENTION_LOSSES), ((4, 2), "kl"), ((3, 2), "mse")],
)
def test_attention_loss_matches_numpy(heads, loss_type):
  """Every loss with the teacher's 4 heads averaged in pairs (the student's peaked head 0 underflows to 0 where the
  teacher attends: the KL's floor); the grouping (before any loss) with the student's 4 heads averaged in pairs, and
  with 3 and 2 heads both averaged to one map."""
  student, teacher, mask = _attention(*heads)
  garbage = (mask > 0)[:, None, :, None]
  value, out, grad = _loss_and_grad(
      distillation.attention_loss,
      np.where(garbage, student, np.nan).astype(np.float32),
      np.where(garbage, teacher, np.inf).astype(np.float32),
      mask,
      loss_type,
      frozen=(0,),
  )
  ref, ref_grad = _numpy_attention_loss(student, teacher, mask, loss_type)
  np.testing.assert_allclose(value, ref, rtol=1e-5)
  np.testing.assert_allclose(out.weight, mask.sum())
  np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-6)


def test_attention_kl_of_equal_maps_is_zero():
  student, _, mask = _attention(4, 2)
  out = distillation.attention_loss(student, _numpy_group(student, 2), mask, "kl")
  np.testing.assert_allclose(out.total, 0.0, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------- schedules


@pytest.mark.parametrize("schedule_type", distillation.SCHEDULES)
def test_compute_schedule(schedule_type):
  """MaxText's compute_schedule: constant keeps the start; linear and cosine meet the midpoint halfway, cosine is
  above the line before it (slow start), and both hold the end value from max_steps on."""
  start, end, steps = 0.9, 0.1, 200
  expected = {
      "constant": lambda s: start,
      "linear": lambda s: start + (end - start) * min(s / steps, 1.0),
      "cosine": lambda s: end + (start - end) * 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0))),
  }[schedule_type]
  schedule = jax.jit(distillation.compute_schedule, static_argnums=(1, 2, 3, 4))
  for step in (0, 50, 100, 200, 300):
    value = schedule(jnp.int32(step), steps, start, end, schedule_type)
    np.testing.assert_allclose(value, expected(step), rtol=1e-6)
    assert value.dtype == jnp.float32
  np.testing.assert_allclose(distillation.compute_schedule(0, steps, start, end, schedule_type), start, rtol=1e-6)
  if schedule_type != "constant":
    np.testing.assert_allclose(distillation.compute_schedule(100, steps, start, end, schedule_type), 0.5, rtol=1e-6)
    np.testing.assert_allclose(distillation.compute_schedule(steps, steps, start, end, schedule_type), end, rtol=1e-6)
  np.testing.assert_allclose(distillation.compute_schedule(150, steps, start, None, schedule_type), start)
  if schedule_type == "cosine":
    assert distillation.compute_schedule(50, steps, start, end, "cosine") > start + (end - start) * 0.25


# ------------------------------------------------------------------------------------------------------- bad settings


def test_bad_settings_are_refused():
  student, teacher = _logits()
  mask = _mask()
  with pytest.raises(ValueError, match="Unknown divergence"):
    distillation.logit_loss(student, teacher, mask, "kl")
  with pytest.raises(ValueError, match="beta"):
    distillation.logit_loss(student, teacher, mask, "jsd", beta=1.5)
  with pytest.raises(ValueError, match="temperature"):
    distillation.logit_loss(student, teacher, mask, temperature=0.0)
  with pytest.raises(ValueError, match="differ"):
    distillation.logit_loss(student, teacher[..., :-1], mask)
  with pytest.raises(ValueError, match="mask"):
    distillation.logit_loss(student, teacher, mask[:, :-1])
  with pytest.raises(ValueError, match="k must be"):
    distillation.teacher_top_k(teacher, V + 1)
  ids, lp, rest = distillation.teacher_top_k(teacher, K)
  with pytest.raises(ValueError, match="teacher_log_rest"):
    distillation.sparse_logit_loss(student, ids, lp, rest[:, :-1], mask)
  with pytest.raises(ValueError, match="teacher_ids"):
    distillation.sparse_logit_loss(student, ids[..., :2], lp, rest, mask)
  features = np.ones((B, T, 4), np.float32)
  with pytest.raises(ValueError, match="project"):
    distillation.feature_loss(features, np.ones((B, T, 5)), mask)
  with pytest.raises(ValueError, match="broadcast"):
    distillation.feature_loss(features, features, np.ones((B, T + 1)))
  with pytest.raises(ValueError, match="Unknown feature"):
    distillation.feature_loss(features, features, mask, "l1")
  student_att, teacher_att, att_mask = _attention(2, 2)
  with pytest.raises(ValueError, match="Unknown attention"):
    distillation.attention_loss(student_att, teacher_att, att_mask, "l2")
  with pytest.raises(ValueError, match=r"\[B, H, Tq, Tk\]"):
    distillation.attention_loss(student_att, teacher_att[..., :-1], att_mask)
  with pytest.raises(ValueError, match="mask"):
    distillation.attention_loss(student_att, teacher_att, att_mask[:, :-1])
  with pytest.raises(ValueError, match="schedule_type"):
    distillation.compute_schedule(0, 10, 1.0, 0.0, "exponential")
  with pytest.raises(ValueError, match="max_steps"):
    distillation.compute_schedule(0, 0, 1.0, 0.0, "linear")

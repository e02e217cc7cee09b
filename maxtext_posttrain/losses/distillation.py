"""Knowledge-distillation losses: a student matched to a frozen teacher's token distributions, features and attention.

Logit distillation (Hinton et al. 2015, "Distilling the knowledge in a neural network") trains the student on the
teacher's softened distribution softmax(z / T) as well as on the hard labels. MaxText's own distillation
(`CombinedDistillationStrategy.compute_loss` in maxtext/trainers/post_train/distillation/distillation_utils.py) uses
  loss = distill_alpha * T^2 * KL(teacher_T || student_T) + (1 - distill_alpha) * CE(student, labels)
         + distill_beta * feature_loss(out_proj activations)
with each term a mean over valid tokens; this module gives the soft and feature terms in a form that adds up over
gradient-accumulation microbatches (a numerator `total` and its `weight`, as the other losses here), leaving the
hard cross entropy to `cross_entropy.token_cross_entropy` and the weighting to the objective. The T^2 factor keeps
the soft term's gradients, which shrink as 1/T^2 for large T, on the scale of the hard term's as T varies.

Besides MaxText's forward KL, on-policy distillation (Agarwal et al. 2024, "On-policy distillation of language
models: learning from self-generated mistakes", GKD) scores the student's own samples with a reverse KL or a
generalized Jensen-Shannon divergence, which keep a small student from spreading mass over everything the teacher
deems plausible. Every divergence is computed in log space from log-softmaxes, so peaked distributions (large
logits) stay finite. The same per-token divergence at T = 1 serves RL objectives that add a KL-to-teacher term.

A teacher can also be given sparsely, as its top-k ids and log-probs (online, to save memory; offline, read from a
file): the rest of its mass is kept as one extra bucket, and the student's distribution is collapsed onto the same
k + 1 buckets, so the divergence is still one between two proper distributions (unlike MaxText's sparse mode,
which renormalises both over the top-k and so cannot see the student's mass outside them).

Feature transfer (FitNets, Romero et al. 2015; MaxText's distill_beta on out_proj activations) and attention
transfer (MiniLM's KL between attention distributions, Wang et al. 2020; TinyBERT's MSE, Jiao et al. 2020) are
per-token losses between already-aligned arrays; any learned projection lives with the model. `compute_schedule`
anneals alpha, temperature and beta as MaxText's distill_*_end / distill_*_schedule keys do.

Teacher inputs never carry a gradient (a stop_gradient is applied here), so callers need not detach them. Tokens
outside the mask are ignored, even if their entries are not finite.
"""

import dataclasses

import jax
import jax.numpy as jnp
import optax

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
FEATURE_LOSSES = ("cosine", "l2")
ATTENTION_LOSSES = ("kl", "mse", "cosine")
SCHEDULES = ("constant", "linear", "cosine")

# Log-probabilities are floored here (the scale of `logprobs.mask_undecodable`'s masked logit): a zero probability
# then contributes an exact 0 to every term, with no -inf - -inf (or its nan gradient) in the sums.
_LOG_FLOOR = -1e30
# MaxText's floor on the squared norm in its cosine feature loss (optax.cosine_distance(..., epsilon=1e-6)): an
# all-zero vector has cosine 0 with anything instead of 0/0.
_COSINE_EPSILON = 1e-6


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DistillationLoss:
  """An aggregated loss: the loss is total / weight.

  Attributes:
    total: sum over tokens (or query positions) of mask * per-token loss.
    weight: the sum of the mask.
    metrics: numerators over the same weight, so each metric is metrics[k] / weight and microbatch numerators add up.
      The logit losses give "divergence" (at temperature T, without the T^2 of `total`: MaxText's kl_div_at_T) and
      "top1_agreement" (tokens where the student's most likely id is the teacher's); the others give none.
  """

  total: jax.Array
  weight: jax.Array
  metrics: dict[str, jax.Array]


def _check_temperature(temperature: float | jax.Array) -> None:
  if isinstance(temperature, (int, float)) and temperature <= 0:
    raise ValueError(f"temperature must be > 0, got {temperature}.")


def _check_divergence(divergence: str, beta: float) -> None:
  if divergence not in DIVERGENCES:
    raise ValueError(f"Unknown divergence {divergence!r}; expected one of {DIVERGENCES}.")
  if divergence == "jsd" and not 0.0 <= beta <= 1.0:
    raise ValueError(f"The JSD's beta must be in [0, 1], got {beta}.")


def _check_mask(mask: jax.Array, shape: tuple[int, ...], what: str) -> jax.Array:
  if jnp.shape(mask) != shape:
    raise ValueError(f"mask {jnp.shape(mask)} must be {what} {shape}.")
  return jnp.asarray(mask)


def _kl(log_p: jax.Array, log_q: jax.Array) -> jax.Array:
  """KL(p || q) over the last axis from floored log-probabilities."""
  return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)


def _bucket_divergence(log_p: jax.Array, log_q: jax.Array, divergence: str, beta: float) -> jax.Array:
  """The divergence of student q from teacher p, both log-probabilities over the same buckets on the last axis.

  forward_kl is KL(p || q), mode-covering (Hinton's and MaxText's); reverse_kl is KL(q || p), mode-seeking. jsd is
  GKD's generalized JSD, JSD_beta(p || q) = beta KL(p || m) + (1 - beta) KL(q || m) with m = beta p + (1 - beta) q.
  It vanishes at both ends, as JSD_beta ~ beta KL(p || q) for small beta and ~ (1 - beta) KL(q || p) near 1; beta 0
  and 1 are therefore taken, as TRL's `generalized_jsd_loss` does, to mean those limits' shapes, the forward and the
  reverse KL, rather than a loss of 0 (so the loss's scale jumps at the two ends).
  """
  log_p, log_q = jnp.maximum(log_p, _LOG_FLOOR), jnp.maximum(log_q, _LOG_FLOOR)
  if divergence == "forward_kl" or (divergence == "jsd" and beta == 0.0):
    return _kl(log_p, log_q)
  if divergence == "reverse_kl" or (divergence == "jsd" and beta == 1.0):
    return _kl(log_q, log_p)
  log_m = jnp.logaddexp(jnp.log(beta) + log_p, jnp.log1p(-beta) + log_q)
  return beta * _kl(log_p, log_m) + (1.0 - beta) * _kl(log_q, log_m)


def token_divergence(
    student_logits: jax.Array,
    teacher_logits: jax.Array,
    divergence: str = "forward_kl",
    temperature: float | jax.Array = 1.0,
    beta: float = 0.5,
) -> jax.Array:
  """Per-token divergence between softmax(teacher_logits / T) and softmax(student_logits / T), without T^2.

  For vocabulary padding, mask both sides' logits with `logprobs.mask_undecodable` first: its finite masked logit
  gives those ids probability 0 on both sides, and so no part in the divergence.

  Args:
    student_logits: [..., V] (differentiated; any float dtype, computed in float32).
    teacher_logits: [..., V] (not differentiated).
    divergence: one of DIVERGENCES; see `_bucket_divergence` for the JSD's beta convention.
    temperature: T > 0, applied to both sides; passed traced, a scheduled T does not recompile a jitted caller.
    beta: the JSD's interpolation weight in [0, 1] (a Python float: its ends are special cases); else unused.

  Returns:
    [...] float32, every entry >= 0 up to rounding.
  """
  _check_divergence(divergence, beta)
  _check_temperature(temperature)
  if jnp.shape(student_logits) != jnp.shape(teacher_logits):
    raise ValueError(f"student_logits {jnp.shape(student_logits)} and teacher_logits {jnp.shape(teacher_logits)} differ.")
  log_q = jax.nn.log_softmax(jnp.asarray(student_logits).astype(jnp.float32) / temperature, axis=-1)
  teacher_logits = jax.lax.stop_gradient(jnp.asarray(teacher_logits).astype(jnp.float32))
  log_p = jax.nn.log_softmax(teacher_logits / temperature, axis=-1)
  return _bucket_divergence(log_p, log_q, divergence, beta)


def _tail_logsumexp(scaled_logits: jax.Array, ids: jax.Array) -> jax.Array:
  """logsumexp over the ids of the last axis not in `ids` (distinct per token); -inf when they cover the vocabulary.

  Taken over the tail itself rather than as log(1 - sum of the top-k probabilities), which loses a small tail to
  cancellation (below ~1e-7 of the mass in float32).
  """
  in_top = jnp.put_along_axis(jnp.zeros(scaled_logits.shape, bool), ids, True, axis=-1, inplace=False)
  return jax.nn.logsumexp(scaled_logits, axis=-1, where=~in_top)


def teacher_top_k(
    teacher_logits: jax.Array, k: int, temperature: float | jax.Array = 1.0
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The sparse form of softmax(teacher_logits / T): its k most likely ids, their log-probs, the log of the rest.

  The same triple serves online top-k distillation and an offline file, which should store exactly it: ids, log-probs
  and log-rest, at the temperature of the run that reads it. T is thus fixed when the file is written. It cannot be
  changed later because the normaliser logsumexp(z / T) and the rest mass at another T depend on the tail logits,
  which are not kept: raw top-k logits plus logsumexp(z) give the distribution at T = 1 only. (MaxText's
  save_top_k_teacher_logits stores the raw top-k logits alone, which its sparse loss renormalises over the top-k at
  any T, dropping the rest.) A run with a temperature schedule needs the dense teacher, online. The rest is stored as
  its own log, summed over the tail, rather than left to be recovered as 1 - sum exp(log-probs), which cancels
  catastrophically when the tail is small.

  Args:
    teacher_logits: [..., V] (not differentiated).
    k: how many ids to keep, 1 <= k <= V; with k = V the rest is empty (log-rest -inf).
    temperature: T > 0, applied before the log-probs are formed.

  Returns:
    (ids [..., k] int32, most likely first; log_probs [..., k] float32; log_rest [...] float32), with
    sum exp(log_probs) + exp(log_rest) = 1.
  """
  _check_temperature(temperature)
  vocab = jnp.shape(teacher_logits)[-1]
  if not 1 <= k <= vocab:
    raise ValueError(f"k must be in [1, {vocab}] for a vocabulary of {vocab}, got {k}.")
  scaled = jax.lax.stop_gradient(jnp.asarray(teacher_logits).astype(jnp.float32)) / temperature
  top_logits, ids = jax.lax.top_k(scaled, k)
  log_z = jax.nn.logsumexp(scaled, axis=-1)
  return ids.astype(jnp.int32), top_logits - log_z[..., None], _tail_logsumexp(scaled, ids) - log_z


def _student_buckets(student_logits: jax.Array, ids: jax.Array, temperature: float | jax.Array) -> jax.Array:
  """[..., k + 1] log-probs of softmax(student_logits / T) collapsed onto the k ids and the rest bucket."""
  scaled = jnp.asarray(student_logits).astype(jnp.float32) / temperature
  log_z = jax.nn.logsumexp(scaled, axis=-1, keepdims=True)
  top = jnp.take_along_axis(scaled, ids, axis=-1) - log_z
  return jnp.concatenate([top, _tail_logsumexp(scaled, ids)[..., None] - log_z], axis=-1)


def _check_sparse(student_logits, teacher_ids, teacher_logprobs, teacher_log_rest) -> None:
  shape, vocab, k = jnp.shape(student_logits)[:-1], jnp.shape(student_logits)[-1], jnp.shape(teacher_ids)[-1]
  if jnp.shape(teacher_ids) != (*shape, k) or jnp.shape(teacher_logprobs) != (*shape, k) or k > vocab:
    raise ValueError(
        f"teacher_ids {jnp.shape(teacher_ids)} and teacher_logprobs {jnp.shape(teacher_logprobs)} must be [..., k] "
        f"with k <= V for student_logits {jnp.shape(student_logits)}."
    )
  if jnp.shape(teacher_log_rest) != shape:
    raise ValueError(f"teacher_log_rest {jnp.shape(teacher_log_rest)} must be {shape}.")


def sparse_token_divergence(
    student_logits: jax.Array,
    teacher_ids: jax.Array,
    teacher_logprobs: jax.Array,
    teacher_log_rest: jax.Array,
    divergence: str = "forward_kl",
    temperature: float | jax.Array = 1.0,
    beta: float = 0.5,
) -> jax.Array:
  """Per-token divergence between a top-k teacher (k ids + the rest) and the student collapsed onto the same buckets.

  The teacher's buckets are its k log-probs and log-rest, as `teacher_top_k` gives them at this temperature; the
  student's are log softmax(student_logits / T) at the same ids and the log of its mass on all other ids. With
  k = V this is `token_divergence`. A MaxText offline file (raw top-k logits z_k, no rest) can be read as
  log_softmax(z_k / T) with a log-rest of -inf: the teacher's tail is then taken as empty, and unlike MaxText's
  sparse KL the student is still pushed off it. That suits the forward KL and the JSD with beta < 1; the reverse KL
  of a student with mass on an empty bucket is infinite (of the order of 1e30 here, see _LOG_FLOOR).

  Args:
    student_logits: [..., V] (differentiated).
    teacher_ids: [..., k] distinct ids per token (not differentiated).
    teacher_logprobs: [..., k] the teacher's log-probs of those ids at temperature T (not differentiated).
    teacher_log_rest: [...] the log of the teacher's remaining mass at T; -inf for none (not differentiated).
    divergence: one of DIVERGENCES.
    temperature: T > 0, applied to the student here; the teacher's must already be applied.
    beta: the JSD's interpolation weight in [0, 1].

  Returns:
    [...] float32.
  """
  _check_divergence(divergence, beta)
  _check_temperature(temperature)
  _check_sparse(student_logits, teacher_ids, teacher_logprobs, teacher_log_rest)
  teacher_ids = jnp.asarray(teacher_ids).astype(jnp.int32)
  log_p = jnp.concatenate([jnp.asarray(teacher_logprobs), jnp.asarray(teacher_log_rest)[..., None]], axis=-1)
  log_p = jax.lax.stop_gradient(log_p.astype(jnp.float32))
  return _bucket_divergence(log_p, _student_buckets(student_logits, teacher_ids, temperature), divergence, beta)


def _aggregate(
    per_token: jax.Array, agreement: jax.Array, mask: jax.Array, temperature: float | jax.Array
) -> DistillationLoss:
  soft = _masked_mean_loss(per_token, mask)
  metrics = {"divergence": soft.total, "top1_agreement": _masked_mean_loss(agreement.astype(jnp.float32), mask).total}
  total = jnp.square(jnp.asarray(temperature, jnp.float32)) * soft.total
  return DistillationLoss(total=total, weight=soft.weight, metrics=metrics)


def logit_loss(
    student_logits: jax.Array,
    teacher_logits: jax.Array,
    mask: jax.Array,
    divergence: str = "forward_kl",
    temperature: float | jax.Array = 1.0,
    beta: float = 0.5,
) -> DistillationLoss:
  """The soft-label loss: total = T^2 * sum over tokens of mask * `token_divergence`.

  With divergence "forward_kl" this is MaxText's soft loss (CombinedDistillationStrategy.compute_loss in
  distillation_utils.py: optax.kl_divergence(log student_T, teacher_T) summed over valid tokens, times T^2, over
  the valid count). The T^2 is applied to every divergence, for the same reason, so that a temperature schedule does
  not also rescale the soft term against the hard one.

  Args:
    student_logits: [..., V] (differentiated).
    teacher_logits: [..., V] (not differentiated).
    mask: [...] per-token weights, nonzero on the tokens to distil (1 for each, or any weights).
    divergence, temperature, beta: as `token_divergence`.

  Returns:
    A DistillationLoss; the loss is total / weight.
  """
  mask = _check_mask(mask, jnp.shape(student_logits)[:-1], "student_logits.shape[:-1]")
  on = (mask != 0)[..., None]
  student_logits = jnp.where(on, jnp.asarray(student_logits).astype(jnp.float32), 0.0)
  teacher_logits = jnp.where(on, jnp.asarray(teacher_logits).astype(jnp.float32), 0.0)
  per_token = token_divergence(student_logits, teacher_logits, divergence, temperature, beta)
  agreement = jnp.argmax(student_logits, axis=-1) == jnp.argmax(teacher_logits, axis=-1)
  return _aggregate(per_token, agreement, mask, temperature)


def sparse_logit_loss(
    student_logits: jax.Array,
    teacher_ids: jax.Array,
    teacher_logprobs: jax.Array,
    teacher_log_rest: jax.Array,
    mask: jax.Array,
    divergence: str = "forward_kl",
    temperature: float | jax.Array = 1.0,
    beta: float = 0.5,
) -> DistillationLoss:
  """`logit_loss` against a top-k teacher: total = T^2 * sum over tokens of mask * `sparse_token_divergence`.

  Args:
    student_logits: [..., V] (differentiated).
    teacher_ids, teacher_logprobs, teacher_log_rest: the teacher as `teacher_top_k` gives it, at temperature T.
    mask: [...] per-token weights, nonzero on the tokens to distil.
    divergence, temperature, beta: as `sparse_token_divergence`.

  Returns:
    A DistillationLoss; the loss is total / weight. Its top1_agreement compares the student's argmax with the
    teacher's most likely kept id.
  """
  _check_sparse(student_logits, teacher_ids, teacher_logprobs, teacher_log_rest)
  mask = _check_mask(mask, jnp.shape(student_logits)[:-1], "student_logits.shape[:-1]")
  on = mask != 0
  k = jnp.shape(teacher_ids)[-1]
  student_logits = jnp.where(on[..., None], jnp.asarray(student_logits).astype(jnp.float32), 0.0)
  # Off the mask: distinct in-range ids and finite log-probs, so nothing there can reach the sums or the gradient.
  teacher_ids = jnp.where(on[..., None], jnp.asarray(teacher_ids).astype(jnp.int32), jnp.arange(k, dtype=jnp.int32))
  teacher_logprobs = jnp.where(on[..., None], jnp.asarray(teacher_logprobs).astype(jnp.float32), 0.0)
  teacher_log_rest = jnp.where(on, jnp.asarray(teacher_log_rest).astype(jnp.float32), 0.0)
  per_token = sparse_token_divergence(
      student_logits, teacher_ids, teacher_logprobs, teacher_log_rest, divergence, temperature, beta
  )
  teacher_best = jnp.take_along_axis(teacher_ids, jnp.argmax(teacher_logprobs, axis=-1)[..., None], axis=-1)[..., 0]
  return _aggregate(per_token, jnp.argmax(student_logits, axis=-1) == teacher_best, mask, temperature)


def _masked_mean_loss(per_token: jax.Array, mask: jax.Array) -> DistillationLoss:
  on = mask != 0
  weights = mask.astype(jnp.float32)
  return DistillationLoss(total=jnp.sum(jnp.where(on, weights * per_token, 0.0)), weight=jnp.sum(weights), metrics={})


def feature_loss(
    student_features: jax.Array, teacher_features: jax.Array, mask: jax.Array, loss_type: str = "cosine"
) -> DistillationLoss:
  """Per-token feature transfer, as MaxText's distill_feature_loss_type (CombinedDistillationStrategy.__init__).

  "cosine": 1 - cos(student, teacher) over the feature axis (optax.cosine_distance with MaxText's epsilon, 1e-6, a
  floor on each squared norm). "l2": the mean over the feature axis of the squared difference (MaxText's _masked_l2
  takes that mean, not the sum). Stacked layers [L, ..., D] with a token mask [...] count each token once per layer,
  as MaxText's count of valid terms, sum(mask) * L.

  Args:
    student_features: [..., D] (differentiated), already projected to the teacher's width if they differ.
    teacher_features: [..., D] (not differentiated).
    mask: per-token weights broadcastable to [...] (the features' shape without D).
    loss_type: one of FEATURE_LOSSES.

  Returns:
    A DistillationLoss; the loss is total / weight.
  """
  if loss_type not in FEATURE_LOSSES:
    raise ValueError(f"Unknown feature loss_type {loss_type!r}; expected one of {FEATURE_LOSSES}.")
  if jnp.shape(student_features) != jnp.shape(teacher_features):
    raise ValueError(
        f"student_features {jnp.shape(student_features)} and teacher_features {jnp.shape(teacher_features)} differ; "
        "project the student's to the teacher's width first."
    )
  shape = jnp.shape(student_features)[:-1]
  try:
    mask = jnp.broadcast_to(jnp.asarray(mask), shape)
  except ValueError as e:
    raise ValueError(f"mask {jnp.shape(mask)} does not broadcast to the features' {shape}.") from e
  on = (mask != 0)[..., None]
  student = jnp.where(on, jnp.asarray(student_features).astype(jnp.float32), 0.0)
  teacher = jnp.where(on, jax.lax.stop_gradient(jnp.asarray(teacher_features).astype(jnp.float32)), 0.0)
  if loss_type == "cosine":
    per_token = optax.cosine_distance(student, teacher, axis=-1, epsilon=_COSINE_EPSILON)
  else:
    per_token = jnp.mean(jnp.square(student - teacher), axis=-1)
  return _masked_mean_loss(per_token, mask)


def _group_heads(attention: jax.Array, groups: int) -> jax.Array:
  """[B, H, Tq, Tk] -> [B, groups, Tq, Tk], averaging runs of H / groups consecutive heads."""
  b, h, tq, tk = attention.shape
  if h == groups:
    return attention
  return jnp.mean(attention.reshape(b, groups, h // groups, tq, tk), axis=2)


def attention_loss(
    student_attention: jax.Array, teacher_attention: jax.Array, mask: jax.Array, loss_type: str = "kl"
) -> DistillationLoss:
  """Attention transfer between attention probabilities, per query position, averaged over (groups of) heads.

  When the head counts differ and one divides the other, the larger side's heads are averaged in runs of
  consecutive heads down to the smaller count (the grouping of grouped-query attention); otherwise both sides are
  averaged to one map. An average of attention distributions is one, so "kl" stays a divergence. Per map and query:
  "kl" is KL(teacher || student) over the key axis (MiniLM's), with the student's probabilities floored at the
  smallest normal float32 so that one underflowed to 0 where the teacher attends gives a large finite loss, not inf;
  "mse" the mean over keys of the squared difference; "cosine" 1 - their cosine over the keys (epsilon as
  `feature_loss`).

  Args:
    student_attention: [B, Hs, Tq, Tk] probabilities over the key axis (differentiated).
    teacher_attention: [B, Ht, Tq, Tk] (not differentiated).
    mask: [B, Tq] per-query weights, nonzero on the query positions to match.
    loss_type: one of ATTENTION_LOSSES.

  Returns:
    A DistillationLoss over query positions: total = sum of mask * (the loss averaged over head groups).
  """
  if loss_type not in ATTENTION_LOSSES:
    raise ValueError(f"Unknown attention loss_type {loss_type!r}; expected one of {ATTENTION_LOSSES}.")
  s_shape, t_shape = jnp.shape(student_attention), jnp.shape(teacher_attention)
  if len(s_shape) != 4 or len(t_shape) != 4 or s_shape[:1] + s_shape[2:] != t_shape[:1] + t_shape[2:]:
    raise ValueError(f"student_attention {s_shape} and teacher_attention {t_shape} must be [B, H, Tq, Tk] alike.")
  mask = _check_mask(mask, (s_shape[0], s_shape[2]), "[B, Tq] of the attention")
  on = (mask != 0)[:, None, :, None]
  student = jnp.where(on, jnp.asarray(student_attention).astype(jnp.float32), 0.0)
  teacher = jnp.where(on, jax.lax.stop_gradient(jnp.asarray(teacher_attention).astype(jnp.float32)), 0.0)
  heads_s, heads_t = s_shape[1], t_shape[1]
  groups = min(heads_s, heads_t) if max(heads_s, heads_t) % min(heads_s, heads_t) == 0 else 1
  student, teacher = _group_heads(student, groups), _group_heads(teacher, groups)
  if loss_type == "kl":
    tiny = jnp.finfo(jnp.float32).tiny
    per_map = _kl(jnp.log(jnp.maximum(teacher, tiny)), jnp.log(jnp.maximum(student, tiny)))
  elif loss_type == "mse":
    per_map = jnp.mean(jnp.square(student - teacher), axis=-1)
  else:
    per_map = optax.cosine_distance(student, teacher, axis=-1, epsilon=_COSINE_EPSILON)
  return _masked_mean_loss(jnp.mean(per_map, axis=1), mask)


def compute_schedule(
    step: int | jax.Array, max_steps: int, start_value: float, end_value: float | None, schedule_type: str
) -> jax.Array:
  """A distill_* weight at `step`, as MaxText's distillation_utils.compute_schedule (which imports Tunix).

  With progress = clip(step / max_steps, 0, 1): "constant" (or end_value None) gives start_value; "linear"
  start + (end - start) * progress; "cosine" end + (start - end) * (1 + cos(pi * progress)) / 2. Past max_steps the
  value stays at end_value. Unlike MaxText's, an unknown schedule_type is refused even when end_value is None.

  Args:
    step: the training step (traced or not).
    max_steps: the step at which end_value is reached (MaxText passes its config's `steps`), > 0.
    start_value: the value at step 0 (distill_alpha, distill_temperature or distill_beta).
    end_value: the value from max_steps on (distill_*_end), or None for a constant.
    schedule_type: one of SCHEDULES (distill_*_schedule).

  Returns:
    A float32 scalar.
  """
  if schedule_type not in SCHEDULES:
    raise ValueError(f"Unknown schedule_type {schedule_type!r}; expected one of {SCHEDULES}.")
  if max_steps <= 0:
    raise ValueError(f"max_steps must be > 0, got {max_steps}.")
  if end_value is None or schedule_type == "constant":
    return jnp.asarray(start_value, jnp.float32)
  progress = jnp.clip(jnp.asarray(step).astype(jnp.float32) / max_steps, 0.0, 1.0)
  if schedule_type == "linear":
    return start_value + (end_value - start_value) * progress
  return end_value + (start_value - end_value) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))

"""Per-token log-probs of given tokens under the policy distribution, shared by the sampler and the RL losses.

The policy an RL step samples from is softmax(logits / T) at the request's temperature T, so that is the
distribution whose log-probs are scored: the sampler records them with this function and the losses recompute
them with it, which makes the importance ratio at the first iteration on a batch exactly 1 up to numerics. Top-k
and top-p truncation are not part of the scored distribution (the trainer has no cheap way to redo them); with
truncation the recorded log-probs are those of the untruncated tempered distribution.
"""

import jax
import jax.numpy as jnp


def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature: float | jax.Array = 1.0) -> jax.Array:
  """log softmax(logits / temperature)[tokens], computed in float32.

  Computed as `target logit - logsumexp`, the form `cross_entropy.token_cross_entropy` uses, so at T = 1 the
  result is exactly minus the trainer's per-token cross entropy.

  Args:
    logits: [..., vocab] unnormalised scores (any float dtype).
    tokens: [...] integer token ids.
    temperature: the sampling temperature T > 0 (1 for greedy decoding).

  Returns:
    [...] float32 log-probs.
  """
  logits = logits.astype(jnp.float32) / temperature
  target_logits = jnp.take_along_axis(logits, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return target_logits - jax.nn.logsumexp(logits, axis=-1)

"""Token-level cross entropy for SFT, returned as a weighted sum and its weight (see objectives/base.py)."""

import jax
import jax.numpy as jnp

from maxtext_posttrain.losses import logprobs


def token_cross_entropy(
    logits: jax.Array, targets: jax.Array, weights: jax.Array, z_loss: float = 0.0
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Summed next-token cross entropy.

  Args:
    logits: [batch, length, vocab] unnormalised scores (any float dtype; computed in float32).
    targets: [batch, length] integer token ids.
    weights: [batch, length] per-token loss weights (0 for prompt, padding and packing boundaries).
    z_loss: coefficient of the auxiliary log(Z)^2 term (PaLM's z-loss); 0 disables it.

  Returns:
    (total, weight, z_total): sum over tokens of weight * (cross entropy + z_loss * log(Z)^2), the sum of the
    weights, and the z-loss part of `total` alone (for logging).
  """
  logits = logits.astype(jnp.float32)
  weights = weights.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  z_total = z_loss * jnp.sum(weights * jnp.square(log_z))
  total = jnp.sum(weights * (log_z - logprobs.target_logits(logits, targets))) + z_total
  return total, jnp.sum(weights), z_total

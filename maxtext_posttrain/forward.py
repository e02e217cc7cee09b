"""The forward passes post-training reads from a MaxText model: logits, per-token log-probs, and scalar-head values.

Every objective and role reads a model through these functions, so there is one place that knows how MaxText's
model is called. A role with a scalar head (a PPO critic, a reward model) is MaxText's own model with one extra
[emb_dim, 1] projection, `scalar_head`, attached beside its LM head: the value at a position is that projection of
the decoder's final hidden state, normalised by MaxText's own final norm, exactly the vector the LM head reads. The
decoder is MaxText's; nothing of it is re-implemented. Parameter paths stay MaxText's (plus `scalar_head/kernel`),
so a policy checkpoint loads into a critic's decoder and `load_parameters_path` reads scalar-head checkpoints.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from maxtext.layers import linears
from maxtext_posttrain.losses import logprobs as logprobs_lib

SCALAR_HEAD = "scalar_head"


def _scalar_head_call(self, decoder_input_tokens, decoder_positions, decoder_segment_ids=None, enable_dropout=False, **_):
  """The call of a MaxText model with a scalar head: [N, L] float32 values, position j's reading the tokens up to
  and including inputs[:, j].

  MaxText's decoder returns (logits, hidden state, caches); the hidden state is the last layer's output before the
  final norm, which `decoder_norm` applies here as MaxText's `apply_output_head` does before the LM head. The logits
  the decoder also computes are unused, and XLA drops them from the compiled program. It is the model's `__call__`
  (not a function beside it) because qwix's LoRA intercepts the operations of `__call__`: a critic under LoRA
  computes through its adapters only when called this way.
  """
  _, hidden, _ = self.decoder(
      shared_embedding=self.token_embedder,
      decoder_input_tokens=decoder_input_tokens,
      decoder_positions=decoder_positions,
      decoder_segment_ids=decoder_segment_ids,
      deterministic=not enable_dropout,
      model_mode="train",
  )
  return getattr(self, SCALAR_HEAD)(self.decoder.decoder_norm(hidden))[..., 0].astype(jnp.float32)


_SCALAR_CLASSES: dict[type, type] = {}


def _scalar_class(base: type) -> type:
  """One subclass per MaxText model class, so graphs built twice (abstract, then concrete) share their type."""
  if base not in _SCALAR_CLASSES:
    _SCALAR_CLASSES[base] = type(f"ScalarHead{base.__name__}", (base,), {"__call__": _scalar_head_call})
  return _SCALAR_CLASSES[base]


def attach_scalar_head(model: nnx.Module, config) -> nnx.Module:
  """`model` with a zero-initialised `scalar_head` (MaxText's DenseGeneral, emb_dim -> 1, kernel sharded like the
  embedding dimension), called for values instead of logits (as qwix retypes the models it wraps). Zeros make every
  value and reward 0 at the start, whatever the decoder: a fresh critic predicts nothing, and a fresh reward model
  ranks every pair as a tie."""
  setattr(
      model,
      SCALAR_HEAD,
      linears.DenseGeneral(
          config.emb_dim,
          1,
          weight_dtype=config.weight_dtype,
          dtype=config.dtype,
          kernel_init=lambda key, shape, dtype, *_: jnp.zeros(shape, dtype),
          kernel_axes=("embed", None),
          matmul_precision=config.matmul_precision,
          rngs=nnx.Rngs(0),
      ),
  )
  model.__class__ = _scalar_class(type(model))
  return model


def has_scalar_head(tree) -> bool:
  """Whether a model, its state or a checkpoint's params dict carries a scalar head."""
  if isinstance(tree, nnx.Module):
    return hasattr(tree, SCALAR_HEAD)
  return SCALAR_HEAD in tree


def logits(model, inputs: jax.Array, positions: jax.Array, segmentation: jax.Array, enable_dropout=False) -> jax.Array:
  """[N, L, vocab] next-token logits of a MaxText model."""
  return model(
      decoder_input_tokens=inputs,
      decoder_positions=positions,
      decoder_segment_ids=segmentation,
      enable_dropout=enable_dropout,
  )


def token_logps(
    model,
    inputs: jax.Array,
    positions: jax.Array,
    segmentation: jax.Array,
    targets: jax.Array,
    temperature: float | jax.Array = 1.0,
    num_pieces: int | None = None,
    enable_dropout: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """([N, L] log-probs of `targets` under softmax(logits / T), the [N, L, vocab] tempered float32 logits).

  With `num_pieces` (the tokenizer's) the ids it cannot decode are masked out as the sampler masks them, so the
  scored distribution is the sampled one; None scores the whole vocabulary.
  """
  scores = logits(model, inputs, positions, segmentation, enable_dropout).astype(jnp.float32) / temperature
  if num_pieces is not None:
    scores = logprobs_lib.mask_undecodable(scores, num_pieces)
  return logprobs_lib.token_logprobs(scores, targets), scores


def scalars(
    model, inputs: jax.Array, positions: jax.Array, segmentation: jax.Array, enable_dropout: bool = False
) -> jax.Array:
  """[N, L] float32 values of a model with a scalar head (`attach_scalar_head`)."""
  return model(
      decoder_input_tokens=inputs,
      decoder_positions=positions,
      decoder_segment_ids=segmentation,
      enable_dropout=enable_dropout,
  )


def last_token_scalars(model, batch: dict[str, jax.Array]) -> jax.Array:
  """[N] scalar-head output at each row's last token (the last nonzero of `segmentation`), read over rows whose
  `inputs` hold the whole sequence (`data.preference.side_arrays`): a reward model's score of a completion."""
  values = scalars(model, batch["inputs"], batch["positions"], batch["segmentation"])
  last = jnp.maximum(jnp.sum(batch["segmentation"] != 0, axis=-1) - 1, 0)
  return jnp.take_along_axis(values, last[:, None], axis=-1)[:, 0]

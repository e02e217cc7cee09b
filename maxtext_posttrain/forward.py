"""The forward passes post-training reads from a MaxText model: logits, per-token log-probs, and scalar-head values.

Every objective and role reads a model through these functions, so there is one place that knows how MaxText's
model is called. A role with a scalar head (a PPO critic, a reward model) is MaxText's own model with one extra
[emb_dim, 1] projection, `scalar_head`: the value at a position is that projection of the decoder's final hidden
state, normalised by MaxText's own final norm, exactly the vector the LM head reads. The decoder is MaxText's;
nothing of it is re-implemented. Parameter paths stay MaxText's (plus `scalar_head/kernel`), so a policy checkpoint
loads into a critic's decoder and `load_parameters_path` reads scalar-head checkpoints.

A scalar-head model has no LM head's output projection: where MaxText's model has its own
(`logits_via_embedding=false`), its `decoder.logits_dense` is replaced by `NoOutputProjection`, which holds no
weights. MaxText's decoder still calls it (the decoder computes logits on every call) and gets zeros that nothing
reads, which XLA drops: the values are the same, while the role's weights, gradients, optimizer moments and
checkpoints leave out vocab x emb_dim parameters (0.53B for llama3.1-8b). A checkpoint holding the projection (a
policy's) still loads into a scalar-head model (`without_output_projection`). With tied embeddings the embedding
table is also the decoder's input, and stays.

A role with an LM head can compute its logits at chosen positions only (`logit_index`): an RL or preference loss
reads the completion's tokens, so the LM head, its float32 logits and their softmax skip the prompt (the decoder's
layers still run over every token, which the completion attends to). With a vocabulary of 100k+ ids the logits are
the largest activations of a step, so this cuts memory as well as FLOPs.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from maxtext.common.common_types import MODEL_MODE_TRAIN
from maxtext.layers import linears
from maxtext_posttrain.losses import logprobs as logprobs_lib

SCALAR_HEAD = "scalar_head"


def _hidden_state(model, decoder_input_tokens, decoder_positions, decoder_segment_ids, enable_dropout) -> jax.Array:
  """[N, L, emb] the decoder's final hidden state: the last layer's output before the final norm.

  MaxText's decoder returns (logits, hidden state, caches[, expert ids]); the logits it also computes are unused by
  the callers here, and XLA drops them from the compiled program."""
  return model.decoder(
      shared_embedding=model.token_embedder,
      decoder_input_tokens=decoder_input_tokens,
      decoder_positions=decoder_positions,
      decoder_segment_ids=decoder_segment_ids,
      deterministic=not enable_dropout,
      model_mode=MODEL_MODE_TRAIN,
  )[1]


def _scalar_head_call(self, decoder_input_tokens, decoder_positions, decoder_segment_ids=None, enable_dropout=False, **_):
  """The call of a MaxText model with a scalar head: [N, L] float32 values, position j's reading the tokens up to
  and including inputs[:, j].

  `decoder_norm` normalises the hidden state as MaxText's `apply_output_head` does before the LM head. It is the
  model's `__call__` (not a function beside it) because qwix's LoRA intercepts the operations of `__call__`: a
  critic under LoRA computes through its adapters only when called this way.
  """
  hidden = _hidden_state(self, decoder_input_tokens, decoder_positions, decoder_segment_ids, enable_dropout)
  return getattr(self, SCALAR_HEAD)(self.decoder.decoder_norm(hidden))[..., 0].astype(jnp.float32)


def _lm_head_call(base: type):
  """The call of a MaxText model (class `base`) with `logit_index` as well: [N, W] positions whose logits alone are
  computed, [N, W, vocab], by MaxText's own `apply_output_head` (final norm, LM head, soft cap) on the hidden states
  there. Without it, MaxText's call. The model's `__call__`, for qwix's LoRA as for the scalar head."""

  def __call__(self, *args, logit_index=None, **kwargs):
    if logit_index is None:
      return base.__call__(self, *args, **kwargs)
    hidden = jnp.take_along_axis(_hidden_state(self, *args, **kwargs), logit_index[..., None], axis=1)
    return self.decoder.apply_output_head(self.token_embedder, hidden, not kwargs["enable_dropout"], MODEL_MODE_TRAIN)

  return __call__


# One subclass per (head, MaxText model class), so graphs built twice (abstract, then concrete) share their type.
_HEAD_CLASSES: dict[tuple[str, type], type] = {}


def _head_class(head: str, base: type) -> type:
  if (head, base) not in _HEAD_CLASSES:
    call = _scalar_head_call if head == "scalar" else _lm_head_call(base)
    _HEAD_CLASSES[head, base] = type(f"{head.capitalize()}Head{base.__name__}", (base,), {"__call__": call})
  return _HEAD_CLASSES[head, base]


def with_lm_head(model: nnx.Module) -> nnx.Module:
  """`model` (MaxText's, before qwix wraps it) retyped so that its call takes `logit_index` (see `logits`)."""
  model.__class__ = _head_class("lm", type(model))
  return model


class NoOutputProjection(nnx.Module):
  """Stands in for MaxText's output projection (`decoder.logits_dense`) in a scalar-head model: no weights, and the
  [..., vocab] logits MaxText's decoder computes as zeros, which no caller reads and XLA drops."""

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size

  def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
    del out_sharding
    return jnp.zeros((*inputs.shape[:-1], self.vocab_size), jnp.float32)


def without_output_projection(params: dict) -> dict:
  """A checkpoint's params dict without MaxText's output projection, which a scalar-head model does not hold."""
  if "logits_dense" not in params.get("decoder", {}):
    return params
  return {**params, "decoder": {k: v for k, v in params["decoder"].items() if k != "logits_dense"}}


def attach_scalar_head(model: nnx.Module, config) -> nnx.Module:
  """`model` with a zero-initialised `scalar_head` (MaxText's DenseGeneral, emb_dim -> 1, kernel sharded like the
  embedding dimension), called for values instead of logits (as qwix retypes the models it wraps). Zeros make every
  value and reward 0 at the start, whatever the decoder: a fresh critic predicts nothing, and a fresh reward model
  ranks every pair as a tie. An untied output projection gives way to `NoOutputProjection`."""
  if not config.logits_via_embedding:
    model.decoder.logits_dense = NoOutputProjection(config.vocab_size)
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
  model.__class__ = _head_class("scalar", type(model))
  return model


def has_scalar_head(tree) -> bool:
  """Whether a model, its state or a checkpoint's params dict carries a scalar head."""
  if isinstance(tree, nnx.Module):
    return hasattr(tree, SCALAR_HEAD)
  return SCALAR_HEAD in tree


def logits(
    model,
    inputs: jax.Array,
    positions: jax.Array,
    segmentation: jax.Array,
    enable_dropout=False,
    logit_index: jax.Array | None = None,
) -> jax.Array:
  """[N, L, vocab] next-token logits of a MaxText model; with `logit_index` ([N, W] positions of each row, of a model
  `with_lm_head`) those positions' only, [N, W, vocab]."""
  kwargs = {} if logit_index is None else {"logit_index": logit_index}
  return model(
      decoder_input_tokens=inputs,
      decoder_positions=positions,
      decoder_segment_ids=segmentation,
      enable_dropout=enable_dropout,
      **kwargs,
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
    logit_index: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """([N, L] log-probs of `targets` under softmax(logits / T), the [N, L, vocab] tempered float32 logits); with
  `logit_index` ([N, W] positions, see `logits`) both at those positions only: [N, W] and [N, W, vocab].

  With `num_pieces` (the tokenizer's) the ids it cannot decode are masked out as the sampler masks them, so the
  scored distribution is the sampled one; None scores the whole vocabulary.
  """
  scores = logits(model, inputs, positions, segmentation, enable_dropout, logit_index).astype(jnp.float32) / temperature
  if logit_index is not None:
    targets = jnp.take_along_axis(targets, logit_index, axis=1)
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

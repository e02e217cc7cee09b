"""Per-layer attention probabilities and attention out-projection activations, read from MaxText's own forward pass.

Attention transfer (MiniLM's KL between attention distributions, TinyBERT's MSE) and feature transfer (FitNets,
MaxText's distill_beta) compare what a student's and a teacher's layers compute. Both are read here from the
computation MaxText runs rather than from a re-implementation of attention, so they carry RoPE, MaxText's query
scaling (folded into the query kernel's initialisation), soft caps, sliding windows, sinks and the causal and packing
masks exactly as the model applies them, and gradients reach the student's weights through them.

- Attention probabilities: `enable_capture` retypes each of a model's `AttentionOp`s (one instance, not MaxText's
  class: as `forward.attach_scalar_head` retypes a model) to a subclass whose `compute_local_attention`, the softmax
  of MaxText's dot-product attention, also sows exp(logit - max) / sum of MaxText's masked logits, with MaxText's own
  max and sum (so a sink keeps its share of the mass and a row sums to less than 1). The sow is a no-op outside
  `nnx.capture`, so an enabled model called as usual computes exactly what it did before.
- Out-projection activations: MaxText's `Attention` sows them itself, as `out_projection_activations`, when its
  config has distill_beta > 0 (its distillation reads them then, and its config validation allows that only with
  scan_layers=true); a model built without it sows none, so `enable_capture(features=True)` refuses it rather than
  returning nothing.
- Hidden states: each decoder layer (`decoder.get_layers()`) is retyped likewise to sow the output it returns, the
  residual stream after the layer (FitNets' hint; TinyBERT's hidden-state loss), again a no-op outside the capture.

`forward_with_captures` runs the model under `nnx.capture`, which collects the sown values through MaxText's layer
scan and leaves nothing on the model (repeated calls do not accumulate), and stacks them over the decoder's layers.
Supported: attention=dot_product (flash and cuDNN kernels never form the probabilities); training-mode calls (a
decode step normalises over its KV-cache pieces after the softmax); scan_layers true or false (then attention
only); decoders whose layers (`decoder.get_layers()`) hold one attention each, as llama2's; blocks of several layers
(gemma3's and gemma4's scanned attention patterns) are refused. The probabilities are [layers, B, heads, T, T], as
large as attention weights are at long sequence lengths.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from maxtext.common import common_types
from maxtext.layers import attention_op
from maxtext_posttrain import forward

ATTENTION = "attention_probs"
FEATURES = "out_projection_activations"  # the name MaxText's Attention sows under
HIDDEN = "hidden_states"


_CAPTURING_CLASSES: dict[type, type] = {}


def _capturing_class(base: type) -> type:
  """`base`, a MaxText AttentionOp class, whose softmax also sows its normalised weights (`base` itself if it does
  already). One subclass per class, so graphs built twice (abstract, then concrete) share their type."""
  if issubclass(base, tuple(_CAPTURING_CLASSES.values())):
    return base
  if base not in _CAPTURING_CLASSES:

    class Capturing(base):

      def compute_local_attention(self, attn_weights, value, q_seq_len, model_mode, wv_product_einsum, sinks=None):
        out, local_max, local_sum = super().compute_local_attention(
            attn_weights, value, q_seq_len, model_mode, wv_product_einsum, sinks
        )
        if model_mode == common_types.MODEL_MODE_TRAIN:
          b, n_kv, groups, t, s = attn_weights.shape  # query head h reads kv head h // groups, as in qk_product
          logits = attn_weights.reshape(b, n_kv * groups, t, s)
          # local_max and local_sum are [B, Tq, heads, 1].
          probabilities = jnp.exp(logits - jnp.swapaxes(local_max, 1, 2)) / jnp.swapaxes(local_sum, 1, 2)
          self.sow(nnx.Intermediate, ATTENTION, probabilities, capture_noop=True)
        return out, local_max, local_sum

    Capturing.__name__ = Capturing.__qualname__ = f"Capturing{base.__name__}"
    _CAPTURING_CLASSES[base] = Capturing
  return _CAPTURING_CLASSES[base]


_HIDDEN_CLASSES: dict[type, type] = {}


def _hidden_class(base: type) -> type:
  """`base`, a MaxText decoder layer class, whose call also sows its output, the layer's hidden state (`base`
  itself if it does already). One subclass per class, as `_capturing_class`."""
  if issubclass(base, tuple(_HIDDEN_CLASSES.values())):
    return base
  if base not in _HIDDEN_CLASSES:

    class HiddenSowing(base):

      def __call__(self, *args, **kwargs):
        out = super().__call__(*args, **kwargs)
        self.sow(nnx.Intermediate, HIDDEN, out[0] if isinstance(out, tuple) else out, capture_noop=True)
        return out

    HiddenSowing.__name__ = HiddenSowing.__qualname__ = f"HiddenSowing{base.__name__}"
    _HIDDEN_CLASSES[base] = HiddenSowing
  return _HIDDEN_CLASSES[base]


def enable_capture(model: nnx.Module, attention: bool = True, features: bool = False, hidden: bool = False) -> nnx.Module:
  """`model`, whose `forward_with_captures` returns its attention probabilities (`attention`), out-projection
  activations (`features`: the model's config must have distill_beta > 0, which makes MaxText sow them) and its
  decoder layers' outputs (`hidden`: each layer retyped as the attention ops are, to sow what it returns). Idempotent;
  apply it before `nnx.split` (or inside a role's model initializer) so that the graph definition carries it."""
  if features and model.config.distill_beta <= 0:
    raise ValueError(
        f"Out-projection activations are sown by MaxText only when distill_beta > 0 (the model's config has "
        f"distill_beta={model.config.distill_beta}): build the model with a positive distill_beta."
    )
  if hidden:
    for layer in model.decoder.get_layers():
      layer.__class__ = _hidden_class(type(layer))
  if attention:
    for path, module in nnx.iter_modules(model):
      if not isinstance(module, attention_op.AttentionOp):
        continue
      if module.attention_kernel != "dot_product":
        raise ValueError(
            f"Attention capture needs attention=dot_product; {'/'.join(map(str, path))} runs "
            f"{module.attention_kernel!r}, whose kernel never forms the attention probabilities."
        )
      module.__class__ = _capturing_class(type(module))
  return model


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Captures:
  """What one forward pass sowed; per-layer arrays are stacked over the decoder's layers in execution order.

  Attributes:
    attention: [layers, B, heads, Tq, Tk] softmax over keys after MaxText's masks, in MaxText's softmax dtype
      (float32 with float32_logits or a float32 model); None without attention capture.
    features: [layers, B, T, emb_dim] attention out-projection activations in the model's dtype; None unless
      distill_beta > 0.
    hidden: [layers, B, T, emb_dim] each decoder layer's output (the last one's is the hidden state MaxText's final
      norm and LM head read); None without hidden capture.
    intermediates: everything sown during the call, by module path, as `nnx.capture` returns it: the capture collects
      MaxText's other sown values too (e.g. a MoE load-balance loss), which are found here instead of on the model.
  """

  attention: jax.Array | None
  features: jax.Array | None
  hidden: jax.Array | None
  intermediates: nnx.State


def stacked(model: nnx.Module, intermediates: nnx.State, name: str) -> jax.Array | None:
  """[layers, ...]: the values sown once per decoder layer under `name` in `intermediates` (from
  `forward_with_captures`), in the decoder's layer order; None when nothing was sown under `name`."""
  sown = [(path, var.get_value()) for path, var in nnx.to_flat_state(intermediates) if path[-1] == name]
  if not sown:
    return None
  module_paths = {id(module): path for path, module in nnx.iter_modules(model)}
  layers = []
  for layer in model.decoder.get_layers():
    prefix = module_paths[id(layer)]
    values = [value for path, value in sown if path[: len(prefix)] == prefix]
    if len(values) != 1 or len(values[0]) != 1:
      raise ValueError(
          f"Decoder layer {'/'.join(map(str, prefix))} sowed {name} {sum(map(len, values))} times in one call; "
          "capture supports decoders whose layers hold one attention each, called once."
      )
    layers.append(values[0][0] if model.config.scan_layers else values[0][0][None])
  return jnp.concatenate(layers)


def forward_with_captures(
    model: nnx.Module,
    inputs: jax.Array,
    positions: jax.Array,
    segmentation: jax.Array,
    enable_dropout: bool = False,
) -> tuple[jax.Array, Captures]:
  """([N, L, vocab] logits as `forward.logits`, the `Captures` of that call) of a model given `enable_capture`."""
  logits, intermediates = nnx.capture(forward.logits, nnx.Intermediate)(
      model, inputs, positions, segmentation, enable_dropout
  )
  return logits, Captures(
      attention=stacked(model, intermediates, ATTENTION),
      features=stacked(model, intermediates, FEATURES),
      hidden=stacked(model, intermediates, HIDDEN),
      intermediates=intermediates,
  )

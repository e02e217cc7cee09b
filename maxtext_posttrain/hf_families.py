"""What the Hugging Face commands share: the model families they convert, the RoPE layouts, and `--hf_path`.

`maxtext_posttrain.hf_export` writes a trained model as a Hugging Face checkpoint and `maxtext_posttrain.hf_import`
reads one into a MaxText params checkpoint, each with MaxText's per-family mappings and hooks
(`maxtext.checkpoint_conversion.utils.param_mapping`), which are keyed by a published model's name.
"""

import jax.numpy as jnp
import transformers
from absl import flags

from maxtext.checkpoint_conversion.utils import param_mapping

from maxtext_posttrain import config as config_lib

# MaxText decoder block -> (a MaxText model name whose mapping, hooks and shapes convert the block, the Hugging Face
# config class, the architecture's name stem). The name only picks MaxText's functions; the shapes are the config's.
FAMILIES = {
    "llama2": ("llama3.1-8b", transformers.LlamaConfig, "Llama"),
    "qwen3": ("qwen3-0.6b", transformers.Qwen3Config, "Qwen3"),
}


# The shapes of a model in both configs: (Hugging Face field, the MaxText key that sets it, the config attribute that
# holds it). hf_import writes the keys from the fields, hf_export the fields from the attributes.
SHAPES = (
    ("vocab_size", "vocab_size", "vocab_size"),
    ("hidden_size", "base_emb_dim", "emb_dim"),
    ("intermediate_size", "base_mlp_dim", "mlp_dim"),
    ("num_hidden_layers", "base_num_decoder_layers", "num_decoder_layers"),
    ("num_attention_heads", "base_num_query_heads", "num_query_heads"),
    ("num_key_value_heads", "base_num_kv_heads", "num_kv_heads"),
    ("head_dim", "head_dim", "head_dim"),
)


def block(config) -> str:
  """The config's decoder_block as its name."""
  return getattr(config.decoder_block, "value", config.decoder_block)


def _rope_type(config) -> str:
  return getattr(config.rope_type, "value", config.rope_type)


def llama31_rope(config) -> bool:
  """Whether MaxText runs the model with LLaMARotaryEmbedding (as attentions.py picks it)."""
  return config.model_name.startswith("llama3.1") or _rope_type(config).startswith("llama3.1")


# LLaMARotaryEmbedding's scaling (its constants, maxtext/layers/embeddings.py), in Hugging Face's terms.
LLAMA3_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# MaxText keys that change the positions or the weights a model computes with, which the families' Hugging Face
# configs cannot say: key -> the value they need.
_POSITIONS = {
    "rope_min_timescale": 1,
    "rope_linear_scaling_factor": 1.0,
    "use_untrainable_positional_embedding": False,
    "use_mrope": False,
    "quantization": "",
}


def rope_parameters(config) -> dict:
  """Hugging Face's `rope_parameters` of the RoPE MaxText runs for `config`: its default RoPE, or for the Llama family
  LLaMARotaryEmbedding (with or without its llama3 scaling). Anything else is a ConfigError naming the key."""
  for key, needed in _POSITIONS.items():
    value = getattr(config, key, needed)
    value = getattr(value, "value", value)  # an enum's name
    if value not in (needed, None):
      raise config_lib.ConfigError(f"{key}={value}: the Hugging Face families here need {key}={needed}.")
  theta = float(config.rope_max_timescale)
  if llama31_rope(config):
    if block(config) != "llama2":
      raise config_lib.ConfigError(f"rope_type={_rope_type(config)}: Llama 3.1's RoPE belongs to decoder_block=llama2.")
    scaling = {"rope_type": "llama3", **LLAMA3_SCALING} if config.rope_use_scale else {"rope_type": "default"}
    return scaling | {"rope_theta": theta}
  if _rope_type(config) != "default":
    raise config_lib.ConfigError(
        f"rope_type={_rope_type(config)}: the Hugging Face families here use default or llama3.1."
    )
  return {"rope_type": "default", "rope_theta": theta}


# MaxText's llama hooks turn LLaMARotaryEmbedding's interleaved query/key layout (rotated pairs 2i, 2i + 1) into
# Hugging Face's halves (i, d/2 + i) and back. MaxText's default RotaryEmbedding already rotates halves, so for it
# the kernels are handed to the hooks in the interleaved layout (and taken back from it on import): the conversion
# then leaves them as they are.
ROTATED = ("self_attention-query-kernel", "self_attention-key-kernel")


def rotates_halves(config, name: str) -> bool:
  """Whether MaxText's hooks of `name` permute query and key kernels that a default-RoPE model keeps in halves."""
  return name.startswith("llama3.1") and not llama31_rope(config)


def mappings(config, hf_dict: dict, saving_to_hf: bool) -> tuple[dict, dict, bool]:
  """MaxText's (param mapping, hooks) of the config's family for a Hugging Face config dict, and whether its query and
  key kernels go through the hooks in the interleaved layout (`rotates_halves`)."""
  name = FAMILIES[block(config)][0]
  mapping = param_mapping.PARAM_MAPPING[name](hf_dict, config, config.scan_layers)
  hooks = param_mapping.HOOK_FNS[name](hf_dict, config, config.scan_layers, saving_to_hf=saving_to_hf)
  return mapping, hooks, rotates_halves(config, name)


def as_interleaved(kernel):
  """A kernel whose last axis holds halves, laid out as interleaved pairs (jnp: keeps a global array's sharding)."""
  half = kernel.shape[-1] // 2
  return jnp.stack([kernel[..., :half], kernel[..., half:]], axis=-1).reshape(kernel.shape)


def from_interleaved(kernel):
  return jnp.concatenate([kernel[..., ::2], kernel[..., 1::2]], axis=-1)


def hf_rope(hf) -> dict:
  """A Hugging Face config's RoPE parameters with their type and theta (older configs: rope_theta, rope_scaling)."""
  rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
  rope.setdefault("rope_theta", float(getattr(hf, "rope_theta", 10000.0)))
  return rope | {"rope_type": rope.get("rope_type", rope.get("type", "default"))}


HF_PATH = flags.DEFINE_string(
    "hf_path",
    None,
    "Local directory of the Hugging Face checkpoint (hf_export writes it, hf_import reads it).",
    required=True,
)

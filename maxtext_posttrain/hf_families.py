"""What the Hugging Face commands share: the model families they convert, the RoPE layouts, and `--hf_path`.

`maxtext_posttrain.hf_export` writes a trained model as a Hugging Face checkpoint and `maxtext_posttrain.hf_import`
reads one into a MaxText params checkpoint, each with MaxText's per-family mappings and hooks
(`maxtext.checkpoint_conversion.utils.param_mapping`), which are keyed by a published model's name.
"""

import numpy as np
import transformers
from absl import flags

# MaxText decoder block -> (a MaxText model name whose mapping, hooks and shapes convert the block, the Hugging Face
# config class, the architecture's name stem). The name only picks MaxText's functions; the shapes are the config's.
FAMILIES = {
    "llama2": ("llama3.1-8b", transformers.LlamaConfig, "Llama"),
    "qwen3": ("qwen3-0.6b", transformers.Qwen3Config, "Qwen3"),
}


def block(config) -> str:
  """The config's decoder_block as its name."""
  return getattr(config.decoder_block, "value", config.decoder_block)


def llama31_rope(config) -> bool:
  """Whether MaxText runs the model with LLaMARotaryEmbedding (as attentions.py picks it)."""
  return config.model_name.startswith("llama3.1") or config.rope_type.startswith("llama3.1")


# MaxText's llama hooks turn LLaMARotaryEmbedding's interleaved query/key layout (rotated pairs 2i, 2i + 1) into
# Hugging Face's halves (i, d/2 + i) and back. MaxText's default RotaryEmbedding already rotates halves, so for it
# the kernels are handed to the hooks in the interleaved layout (and taken back from it on import): the conversion
# then leaves them as they are.
ROTATED = ("self_attention-query-kernel", "self_attention-key-kernel")


def rotates_halves(config, name: str) -> bool:
  """Whether MaxText's hooks of `name` permute query and key kernels that a default-RoPE model keeps in halves."""
  return name.startswith("llama3.1") and not llama31_rope(config)


def as_interleaved(kernel):
  half = kernel.shape[-1] // 2
  return np.stack([kernel[..., :half], kernel[..., half:]], axis=-1).reshape(kernel.shape)


def from_interleaved(kernel):
  return np.concatenate([kernel[..., ::2], kernel[..., 1::2]], axis=-1)


HF_PATH = flags.DEFINE_string(
    "hf_path",
    None,
    "Local directory of the Hugging Face checkpoint (hf_export writes it, hf_import reads it).",
    required=True,
)

"""Reads a Hugging Face checkpoint into a MaxText params checkpoint, and prints the keys that build its model.

Post-training usually starts from a published model. MaxText's `to_maxtext` converts its own published configs by
`model_name` and reads every shape from its table of their Hugging Face configs (a checkpoint of another shape is
misread or refused); this command reads the shapes from the checkpoint's config.json, so a Llama- or Qwen3-family
checkpoint of any shape loads (default RoPE, or Llama 3.1's scaling, which MaxText's LLaMARotaryEmbedding runs),
and moves every weight with MaxText's per-family mappings and hooks (`maxtext.checkpoint_conversion`: the layouts,
the RoPE permutation and the query scaling are theirs). Run it with the config the model will train
under (its data, optimizer and mesh keys), and a local Hugging Face directory (config.json, safetensors, tokenizer):

  python -m maxtext_posttrain.hf_import sft.yml --hf_path=/models/my-qwen3 --maxtext_path=/tmp/my-qwen3

It writes `<maxtext_path>/items` (MaxText's params-only layout, as `maxtext_posttrain.peft.export` writes) and prints the
keys to add to any command of the run: `load_parameters_path=<maxtext_path>/items`, the model keys (decoder_block, widths,
depth, norm epsilon, RoPE, tied embeddings) and, when the directory has a tokenizer,
`tokenizer_type=huggingface tokenizer_path=<hf_path>`. `maxtext_posttrain.hf_export` writes it back.
"""

import glob
import json
import os

import jax
import numpy as np
import transformers
from absl import flags
from flax import nnx
from safetensors import safe_open

from maxtext.checkpoint_conversion.utils import utils as conversion
from maxtext.common import checkpointing
from maxtext.utils import max_logging
from maxtext.utils import model_creation_utils

from maxtext_posttrain import cli
from maxtext_posttrain import config as config_lib
from maxtext_posttrain import hf_families
from maxtext_posttrain import mesh as mesh_lib

# Hugging Face model_type -> MaxText decoder_block.
BLOCKS = {"llama": "llama2", "qwen3": "qwen3"}
_FLOATS = {"float32", "bfloat16", "float16"}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def model_keys(hf_path: str) -> list[str]:
  """The MaxText `key=value`s of the model the Hugging Face config at `hf_path` describes (and of its tokenizer)."""
  where = os.path.join(hf_path, "config.json")
  if not os.path.isfile(where):
    raise config_lib.ConfigError(f"--hf_path={hf_path}: no config.json there (hf_import reads a local directory).")
  hf = transformers.AutoConfig.from_pretrained(hf_path)
  block = BLOCKS.get(hf.model_type)
  if block is None:
    raise config_lib.ConfigError(f"{where}: model_type={hf.model_type}; hf_import reads {sorted(BLOCKS)}.")
  rope = hf_families.hf_rope(hf)
  llama3 = rope["rope_type"] == "llama3" and block == "llama2"  # its factors are `check_rope`'s to compare
  unsupported = {
      "attention_bias": getattr(hf, "attention_bias", False),
      "mlp_bias": getattr(hf, "mlp_bias", False),
      "hidden_act": hf.hidden_act if hf.hidden_act != "silu" else None,
      "rope_parameters": rope if rope["rope_type"] != "default" and not llama3 else None,
      "use_sliding_window": getattr(hf, "use_sliding_window", False),
      "quantization_config": getattr(hf, "quantization_config", None),
  }
  for key, value in unsupported.items():
    if value:
      raise config_lib.ConfigError(
          f"{where}: {key}={value} is not read by hf_import (MaxText's maxtext.checkpoint_conversion.to_maxtext "
          "converts its published models by model_name)."
      )
  hf.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads  # older configs lack it
  keys = [f"decoder_block={block}", *(f"{key}={getattr(hf, field)}" for field, key, _ in hf_families.SHAPES)]
  keys += [
      f"normalization_layer_epsilon={hf.rms_norm_eps}",
      f"rope_max_timescale={rope['rope_theta']}",
      *(["rope_type=llama3.1", "rope_use_scale=true"] if llama3 else ["rope_type=default"]),
      f"logits_via_embedding={str(bool(hf.tie_word_embeddings)).lower()}",
      "normalize_embedding_logits=false",
      f"use_qk_norm={str(block == 'qwen3').lower()}",
      "mlp_activations=[silu,linear]",
  ]
  if any(os.path.exists(os.path.join(hf_path, name)) for name in _TOKENIZER_FILES):
    keys += ["tokenizer_type=huggingface", f"tokenizer_path={hf_path}"]
  return keys


def check_rope(config, hf_path: str) -> None:
  """Raises ConfigError unless the model `config` builds runs the checkpoint's RoPE (the training config's keys, a
  model_name say, may set another)."""
  ours = hf_families.rope_parameters(config)
  theirs = hf_families.hf_rope(transformers.AutoConfig.from_pretrained(hf_path))
  differing = {k: (v, theirs.get(k)) for k, v in ours.items() if theirs.get(k) != v}
  if differing:
    raise config_lib.ConfigError(
        f"{os.path.join(hf_path, 'config.json')}: its RoPE differs from the one this config runs ({ours}): "
        f"{differing} (ours, the checkpoint's). Drop the keys that set it (model_name, rope_type, rope_use_scale)."
    )


def _tensor_getter(hf_path: str):
  """A function reading one Hugging Face tensor by name from the directory's safetensors files, as numpy."""
  index = os.path.join(hf_path, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index, encoding="utf-8") as f:
      files = {name: os.path.join(hf_path, file) for name, file in json.load(f)["weight_map"].items()}
  else:
    files = {}
    for path in sorted(glob.glob(os.path.join(hf_path, "*.safetensors"))):
      with safe_open(path, framework="np") as f:
        files |= {name: path for name in f.keys()}
  if not files:
    raise config_lib.ConfigError(f"--hf_path={hf_path}: no safetensors weights there.")

  def get(name: str) -> np.ndarray:
    if name not in files:
      raise ValueError(f"{hf_path}: the checkpoint has no tensor {name}, which the config's model needs.")
    with safe_open(files[name], framework="np") as f:
      tensor = f.get_tensor(name)
    if tensor.dtype.name not in _FLOATS:
      raise config_lib.ConfigError(f"{files[name]}: {name} is {tensor.dtype.name}; hf_import reads {sorted(_FLOATS)}.")
    return tensor

  return get


def _abstract_params(config) -> tuple[dict[str, jax.ShapeDtypeStruct], jax.tree_util.PyTreeDef]:
  """MaxText's flat param names ("params-decoder-...") -> shapes of the model `config` builds, and the tree."""
  _, abstract = model_creation_utils.create_nnx_abstract_model(config, mesh_lib.make_mesh(config))
  leaves, treedef = jax.tree_util.tree_flatten_with_path(nnx.state(abstract, nnx.Param).to_pure_dict())
  names = ["params-" + "-".join(conversion.param_key_parts_from_path(path)) for path, _ in leaves]
  return dict(zip(names, (leaf for _, leaf in leaves))), treedef


def maxtext_params(config, hf_path: str) -> dict:
  """The params dict of the model `config` builds, read from the Hugging Face checkpoint at `hf_path`."""
  hf_dict = transformers.AutoConfig.from_pretrained(hf_path).to_dict()
  mapping, hooks, rotates_halves = hf_families.mappings(config, hf_dict, saving_to_hf=False)
  abstract, treedef = _abstract_params(config)
  get = _tensor_getter(hf_path)
  dtype = np.dtype(config.weight_dtype)
  weights = {}
  for key in conversion.validate_and_filter_param_map_keys(mapping, set(abstract)):
    shape = abstract[key].shape
    if isinstance(mapping[key], list):  # one tensor per layer, through the hooks, stacked on MaxText's scan axis
      axis = config.param_scan_axis
      layer = shape[:axis] + shape[axis + 1 :]
      value = np.stack([conversion.apply_hook_fns(get(n), layer, hooks.get(key)) for n in mapping[key]], axis=axis)
    else:
      value = conversion.apply_hook_fns(get(mapping[key]), shape, hooks.get(key))
    if rotates_halves and key.endswith(hf_families.ROTATED):
      value = hf_families.from_interleaved(value)
    weights[key] = np.asarray(value).astype(dtype).reshape(shape)
  missing = sorted(set(abstract) - set(weights))
  if missing:
    raise ValueError(f"{hf_path}: no Hugging Face tensor maps to {missing[:4]} of the model the keys build.")
  return jax.tree_util.tree_unflatten(treedef, [weights[k] for k in abstract])


def import_checkpoint(argv: list[str], hf_path: str, output: str) -> list[str]:
  """Writes `hf_path`'s weights to `<output>/items` as a MaxText params checkpoint of the model `argv` (a config
  and keys) plus the checkpoint's model keys build; returns the keys a run adds to read it."""
  keys = model_keys(hf_path)
  config = config_lib.initialize([*argv, *keys])
  check_rope(config, hf_path)
  params = maxtext_params(config, hf_path)
  checkpointing.save_params_to_path(
      output, {"params": params}, config.checkpoint_storage_use_ocdbt, config.checkpoint_storage_use_zarr3
  )
  keys = [f"load_parameters_path={os.path.join(output, 'items')}", *keys]
  max_logging.log(f"Read {hf_path} into {output}/items. Run with:\n  {' '.join(keys)}")
  return keys


_MAXTEXT_PATH = flags.DEFINE_string(
    "maxtext_path", None, "Directory of the MaxText params checkpoint it writes (<maxtext_path>/items).", required=True
)


def main(argv: list[str]) -> None:
  import_checkpoint(list(argv), hf_families.HF_PATH.value, _MAXTEXT_PATH.value)


if __name__ == "__main__":
  cli.run(main)

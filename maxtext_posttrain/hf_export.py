"""Writes a trained model as a Hugging Face checkpoint: safetensors, config.json and the tokenizer.

Post-training ends where users serve and share models, and that is Hugging Face's format. MaxText's
`to_huggingface` converts MaxText's published model configs (qwen3-0.6b, llama3.1-8b, ...) and reads them
against its own table of their Hugging Face configs; a post-trained model may have any width or depth, may be a
reward model (a scalar head, which MaxText does not convert) and may carry this project's bundled sentencepiece
tokenizer. This command builds the Hugging Face config from the run's MaxText config, moves every weight with
MaxText's own per-family mappings and hooks (`maxtext.checkpoint_conversion.utils`: the layouts, the RoPE
permutation and the query scaling are theirs) and writes the files with MaxText's writer:

  python -m maxtext_posttrain.hf_export sft.yml load_parameters_path=/tmp/out/sft/checkpoints/299/items \
      --hf_path=/tmp/out/sft_hf

A language model becomes `<Family>ForCausalLM`; a reward model (a posttrain_mode=reward_model run's checkpoint)
becomes `<Family>ForSequenceClassification` with one label, whose `score` reads the last non-padding token as the
reward model does. A LoRA run is exported after `maxtext_posttrain.peft.export` merges its adapters. Families:
MaxText's `llama2` decoder block (Llama 2 and 3 shapes: LlamaForCausalLM) and `qwen3` (Qwen3ForCausalLM), dense,
with MaxText's default RoPE or, for a model_name whose Hugging Face config MaxText's table holds, that config's.
"""

import copy
import os
import shutil
import tempfile

import jax
import numpy as np
import transformers
from flax import nnx

from maxtext.checkpoint_conversion.utils import hf_model_configs
from maxtext.checkpoint_conversion.utils import hf_shape
from maxtext.checkpoint_conversion.utils import param_mapping
from maxtext.checkpoint_conversion.utils import utils as conversion
from maxtext.utils import max_logging

from maxtext_posttrain import checkpoint_guard
from maxtext_posttrain import cli
from maxtext_posttrain import config as config_lib
from maxtext_posttrain import forward
from maxtext_posttrain import hf_families
from maxtext_posttrain import mesh as mesh_lib
from maxtext_posttrain import roles

# MaxText keys whose non-default values the Hugging Face families above cannot express: key -> its default.
_DEFAULTS = {
    "num_experts": 1,
    "attn_logits_soft_cap": 0.0,
    "fused_qkv": False,
    "fused_mlp": False,
    "sliding_window_size": 0,
}
_SCORE = "score.weight"


def _check_exportable(config) -> tuple[str, type, str]:
  block = hf_families.block(config)
  family = hf_families.FAMILIES.get(block)
  if family is None:
    raise config_lib.ConfigError(
        f"decoder_block={block}: hf_export writes the {sorted(hf_families.FAMILIES)} families; MaxText's "
        "maxtext.checkpoint_conversion.to_huggingface converts its other published models by model_name."
    )
  for key, default in _DEFAULTS.items():
    if getattr(config, key, None) not in (default, None):
      raise config_lib.ConfigError(
          f"{key}={getattr(config, key)}: not expressible in {family[2]}'s config (needs {default})."
      )
  if config.logits_via_embedding and (config.normalize_embedding_logits or config.final_logits_soft_cap):
    raise config_lib.ConfigError(
        f"normalize_embedding_logits={config.normalize_embedding_logits}, final_logits_soft_cap="
        f"{config.final_logits_soft_cap}: {family[2]}'s tied LM head neither scales nor caps its logits."
    )
  if list(config.mlp_activations) != ["silu", "linear"]:
    raise config_lib.ConfigError(f"mlp_activations={list(config.mlp_activations)}: {family[2]} uses ['silu', 'linear'].")
  if (block == "qwen3") != bool(config.use_qk_norm):
    raise config_lib.ConfigError(f"use_qk_norm={config.use_qk_norm}: {family[2]} has it {block == 'qwen3'}.")
  if _table_entry(config, family[1]) is None and (config.rope_type != "default" or hf_families.llama31_rope(config)):
    raise config_lib.ConfigError(
        f"rope_type={config.rope_type} (model_name={config.model_name}): outside MaxText's table of Hugging Face "
        "configs, hf_export writes MaxText's default RoPE only."
    )
  return family


def _table_entry(config, config_class):
  """MaxText's Hugging Face config of `model_name`, when it has one of the family's class."""
  known = hf_model_configs.HF_MODEL_CONFIGS.get(config.model_name)
  return known if isinstance(known, config_class) else None


def hf_config(config, tokenizer, scalar_head: bool):
  """The Hugging Face config of the model `config` builds: its shapes, norm epsilon, RoPE, tied embeddings, token ids
  and dtype. A model_name MaxText's table holds starts from that entry (its RoPE scaling, say), shapes overwritten."""
  _, config_class, stem = _check_exportable(config)
  known = _table_entry(config, config_class)
  hf = config_class() if known is None else copy.deepcopy(known)
  rope = {"rope_type": "default"} if known is None else dict(known.rope_parameters)
  fields = {
      "vocab_size": config.vocab_size,
      "hidden_size": config.emb_dim,
      "intermediate_size": config.mlp_dim,
      "num_hidden_layers": config.num_decoder_layers,
      "num_attention_heads": config.num_query_heads,
      "num_key_value_heads": config.num_kv_heads,
      "head_dim": config.head_dim,
      "hidden_act": "silu",
      "rms_norm_eps": config.normalization_layer_epsilon,
      "max_position_embeddings": config.max_target_length if known is None else known.max_position_embeddings,
      "rope_parameters": rope | {"rope_theta": float(config.rope_max_timescale)},
      "tie_word_embeddings": bool(config.logits_via_embedding),
      "bos_token_id": tokenizer.bos_token_id,
      "eos_token_id": tokenizer.eos_token_id,
      "pad_token_id": tokenizer.pad_token_id,
      "attention_bias": False,
      "dtype": str(np.dtype(config.weight_dtype)),
      "architectures": [f"{stem}For{'SequenceClassification' if scalar_head else 'CausalLM'}"],
  }
  if scalar_head:
    fields["num_labels"] = 1
  if hf_families.block(config) == "qwen3":
    fields["layer_types"] = ["full_attention"] * config.num_decoder_layers
    fields["use_sliding_window"] = False
    fields["max_window_layers"] = config.num_decoder_layers
  for key, value in fields.items():
    setattr(hf, key, value)
  return hf


def hf_tokenizer(config):
  """The run's tokenizer as a Hugging Face one: `tokenizer_type=huggingface` loads `tokenizer_path`; a sentencepiece
  model becomes a Llama tokenizer over the same pieces (same ids), adding BOS as the run does."""
  if config.tokenizer_type == "huggingface":
    return transformers.AutoTokenizer.from_pretrained(config.tokenizer_path)
  if config.tokenizer_type != "sentencepiece":
    raise config_lib.ConfigError(
        f"tokenizer_type={config.tokenizer_type}: hf_export writes sentencepiece or huggingface."
    )
  import sentencepiece  # pylint: disable=import-outside-toplevel

  model = sentencepiece.SentencePieceProcessor(model_file=config.tokenizer_path)
  piece = lambda i: model.id_to_piece(i) if i >= 0 else None  # pylint: disable=unnecessary-lambda-assignment
  settings = {
      "tokenizer_class": "LlamaTokenizer",
      "bos_token": piece(model.bos_id()),
      "eos_token": piece(model.eos_id()),
      "unk_token": piece(model.unk_id()),
      "pad_token": piece(model.pad_id()),
      "add_bos_token": bool(config.add_bos),
      "add_eos_token": False,
      "legacy": False,
  }
  with tempfile.TemporaryDirectory() as directory:
    shutil.copy(config.tokenizer_path, os.path.join(directory, "tokenizer.model"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
      import json  # pylint: disable=import-outside-toplevel

      json.dump({k: v for k, v in settings.items() if v is not None}, f)
    return transformers.AutoTokenizer.from_pretrained(directory)


def stored_params(config) -> tuple[dict, bool]:
  """(the weights at `load_parameters_path` as MaxText's params dict, whether they are a reward model's), read into
  the model this config builds: a checkpoint of another shape fails naming the path and the difference."""
  if not config.load_parameters_path:
    raise config_lib.ConfigError("hf_export reads load_parameters_path: set it to a checkpoint's <step>/items.")
  scalar_head = forward.has_scalar_head(checkpoint_guard.stored_params(config.load_parameters_path))
  spec = roles.RoleSpec("exported", trained=False, head="scalar" if scalar_head else "lm")
  model = roles.build_frozen(spec, config, mesh_lib.make_mesh(config))
  return nnx.State(model.state).filter(nnx.Param).to_pure_dict(), scalar_head


def hf_weights(config, params: dict, hf) -> dict[str, np.ndarray]:
  """Hugging Face tensor name -> array of MaxText's params dict, by MaxText's mappings and hooks for the family."""
  name = hf_families.FAMILIES[hf_families.block(config)][0]
  hf_dict = hf.to_dict()
  mapping = param_mapping.PARAM_MAPPING[name](hf_dict, config, config.scan_layers)
  hooks = param_mapping.HOOK_FNS[name](hf_dict, config, config.scan_layers, saving_to_hf=True)
  shapes = hf_shape.HF_SHAPE[name](hf_dict)
  head = params.pop(forward.SCALAR_HEAD, None)
  state = conversion.extract_linen_weights(params)
  if hf_families.rotates_halves(config, name):
    state = {k: hf_families.as_interleaved(v) if k.endswith(hf_families.ROTATED) else v for k, v in state.items()}
  weights = {}
  for key in conversion.validate_and_filter_param_map_keys(mapping, set(state)):
    weights.update(conversion.process_maxtext_param(key, state[key], mapping, hooks, shapes, config))
  if head is not None:  # MaxText's DenseGeneral kernel [emb, 1] is score.weight [1, emb]
    weights = {k: v for k, v in weights.items() if not k.startswith("lm_head")}
    weights[_SCORE] = np.asarray(jax.device_get(head["kernel"])).T.astype(np.dtype(config.weight_dtype))
  return weights


def export(config, output: str) -> str:
  """Writes `load_parameters_path`'s model to `output` as a Hugging Face checkpoint; returns `output`."""
  tokenizer = hf_tokenizer(config)
  params, scalar_head = stored_params(config)
  if scalar_head and output.startswith(("gs://", "hf://")):
    raise config_lib.ConfigError(f"--hf_path={output}: a reward model is written to a local directory (then copied).")
  hf = hf_config(config, tokenizer, scalar_head)
  architectures = hf.architectures
  weights = hf_weights(config, params, hf)
  count = len(weights)
  conversion.save_model_files(weights, hf, tokenizer, None, output)
  if scalar_head:  # MaxText's writer names the family's CausalLM architecture
    hf.architectures = architectures
    hf.to_json_file(os.path.join(output, "config.json"))
  max_logging.log(f"Wrote {architectures[0]} ({count} tensors) from {config.load_parameters_path} to {output}")
  return output


def main(argv: list[str]) -> None:
  export(config_lib.initialize(list(argv)), hf_families.HF_PATH.value)


if __name__ == "__main__":
  cli.run(main)

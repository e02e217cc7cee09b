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
reward model reads the last token (EOS included when the run adds it: the exported tokenizer adds it too). A LoRA
run is exported after `maxtext_posttrain.peft.export` merges its adapters. Families: MaxText's `llama2` decoder
block (LlamaForCausalLM; MaxText's default RoPE or Llama 3.1's) and `qwen3` (Qwen3ForCausalLM), dense. When the run's
tokenizer is a Hugging Face directory holding a config.json of the same family (as `hf_import`'s keys set), the
written config starts from it, keeping what MaxText's config does not hold (context length, token ids,
generation_config.json), shapes and RoPE written from the run's.
"""

import copy
import json
import os
import shutil
import tempfile

import jax
import numpy as np
import transformers
from flax import nnx

from maxtext.checkpoint_conversion.utils import hf_shape
from maxtext.checkpoint_conversion.utils import utils as conversion
from maxtext.utils import max_logging

from maxtext_posttrain import checkpoint_guard
from maxtext_posttrain import cli
from maxtext_posttrain import config as config_lib
from maxtext_posttrain import forward
from maxtext_posttrain import hf_families
from maxtext_posttrain import mesh as mesh_lib
from maxtext_posttrain import roles
from maxtext_posttrain.data import pipeline

# MaxText keys whose non-default values the Hugging Face families above cannot express: key -> its default.
_DEFAULTS = {
    "num_experts": 1,
    "attn_logits_soft_cap": 0.0,
    "fused_qkv": False,
    "fused_mlp": False,
    "sliding_window_size": 0,
}
_SCORE = "score.weight"
_GENERATION_CONFIG = "generation_config.json"
# Texts whose encoding shows a sentencepiece model's normalisation: newlines, repeated spaces, a space after a
# newline, a first word without a space before it. (A text that starts with a space is not among them: Hugging Face's
# Llama tokenizer drops that space into its dummy prefix, one piece fewer than sentencepiece.)
_PROBES = ("Question: 12 + 7 =\nAnswer: 19", "two  spaces", "a\n b", "no-dummy-prefix")


def check_exportable(config) -> tuple[str, type, str]:
  """The family `config`'s model belongs to; a ConfigError naming the key when its Hugging Face config cannot
  describe the model (the RoPE's keys too, `hf_families.rope_parameters`)."""
  if config.lora.enable_lora:
    raise config_lib.ConfigError(
        "lora.enable_lora=true: a policy's adapters merge into a full checkpoint with `python -m "
        "maxtext_posttrain.peft.export`, exported then with the LoRA keys off; a LoRA reward model is not exported."
    )
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
  hf_families.rope_parameters(config)
  return family


def source_config(config, config_class):
  """The Hugging Face config beside the run's Hugging Face tokenizer, when it is one of the family's (`config_class`),
  else None."""
  path = os.path.join(config.tokenizer_path, "config.json")
  if config.tokenizer_type != "huggingface" or not os.path.isfile(path):
    return None
  source = transformers.AutoConfig.from_pretrained(config.tokenizer_path)
  return source if isinstance(source, config_class) else None


def _shape_and_rope(config) -> dict:
  """The Hugging Face config fields that say which model `config` builds: its shapes and RoPE."""
  shapes = {field: getattr(config, attribute) for field, _, attribute in hf_families.SHAPES}
  return shapes | {"rope_parameters": hf_families.rope_parameters(config)}


def same_model(config, source) -> bool:
  """Whether the source config describes the model `config` builds (its context length and generation settings
  then hold for it), rather than another one sharing its tokenizer."""
  return source is not None and all(
      hf_families.hf_rope(source) == value if key == "rope_parameters" else getattr(source, key, None) == value
      for key, value in _shape_and_rope(config).items()
  )


def hf_config(config, tokenizer, scalar_head: bool, source):
  """The Hugging Face config of the model `config` builds: its shapes, norm epsilon, RoPE, tied embeddings and dtype;
  token ids from the source config (`source_config`) when there is one, else from the tokenizer; the context length
  the source's when it describes the same model, else `max_target_length` (at least Llama 3's original context for
  its RoPE, which Hugging Face requires)."""
  _, config_class, stem = check_exportable(config)
  hf = config_class() if source is None else copy.deepcopy(source)
  fields = _shape_and_rope(config) | {
      "hidden_act": "silu",
      "rms_norm_eps": config.normalization_layer_epsilon,
      "tie_word_embeddings": bool(config.logits_via_embedding),
      "attention_bias": False,
      "mlp_bias": False,
      "dtype": str(np.dtype(config.weight_dtype)),
      "architectures": [f"{stem}For{'SequenceClassification' if scalar_head else 'CausalLM'}"],
  }
  if not same_model(config, source):
    original = fields["rope_parameters"].get("original_max_position_embeddings", 0)
    fields["max_position_embeddings"] = max(config.max_target_length, original)
  if source is None:
    fields |= {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    fields["pad_token_id"] = tokenizer.pad_token_id
  if scalar_head:
    fields |= {"num_labels": 1, "pad_token_id": tokenizer.pad_token_id}
  if hf_families.block(config) == "qwen3":
    fields |= {"layer_types": ["full_attention"] * config.num_decoder_layers, "use_sliding_window": False}
    fields["max_window_layers"] = config.num_decoder_layers
  for key, value in fields.items():
    setattr(hf, key, value)
  return hf


def hf_tokenizer(config, scalar_head: bool = False):
  """The run's tokenizer as a Hugging Face one: `tokenizer_type=huggingface` loads `tokenizer_path`; a sentencepiece
  model becomes a Llama tokenizer over the same pieces. Either must encode a text as the run's rows begin and end it
  (BOS when `add_bos`; for a reward model, EOS when `add_eos`, the token it scores), checked on texts that show a
  tokenizer's normalisation; a reward model's also needs a padding token other than EOS, which Hugging Face's
  sequence classifier skips to find the scored token."""
  add_eos = bool(scalar_head and config.add_eos)
  if config.tokenizer_type == "huggingface":
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        config.tokenizer_path, token=config.hf_access_token or None, add_bos_token=config.add_bos, add_eos_token=add_eos
    )
  elif config.tokenizer_type == "sentencepiece":
    tokenizer = _sentencepiece_as_llama(config, add_eos)
  else:
    raise config_lib.ConfigError(
        f"tokenizer_type={config.tokenizer_type}: hf_export writes sentencepiece or huggingface."
    )
  encoder = pipeline.Encoder.from_config(config)
  for text in _PROBES:
    ours = [encoder.bos_id] * (encoder.bos_id is not None) + list(encoder.tokenizer.encode(text))
    ours += [encoder.eos_id] * (add_eos and encoder.eos_id is not None)
    if tokenizer(text)["input_ids"] != ours:
      raise config_lib.ConfigError(
          f"tokenizer_path={config.tokenizer_path}: as a Hugging Face tokenizer it encodes {text!r} as "
          f"{tokenizer(text)['input_ids']}, the run as {ours} (BOS/EOS as add_bos={config.add_bos}"
          f"{f', add_eos={config.add_eos}' if scalar_head else ''} add them; or another normaliser)."
      )
  if scalar_head and tokenizer.pad_token_id in (None, tokenizer.eos_token_id):
    raise config_lib.ConfigError(
        f"tokenizer_path={config.tokenizer_path}: a reward model's tokenizer needs a padding token other than EOS "
        f"(pad id {tokenizer.pad_token_id}, EOS id {tokenizer.eos_token_id}): Hugging Face's sequence classifier "
        "scores the last token that is not padding."
    )
  return tokenizer


def _sentencepiece_as_llama(config, add_eos: bool):
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
      "add_eos_token": add_eos,
      "legacy": False,
  }
  with tempfile.TemporaryDirectory() as directory:
    shutil.copy(config.tokenizer_path, os.path.join(directory, "tokenizer.model"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
      json.dump({k: v for k, v in settings.items() if v is not None}, f)
    return transformers.AutoTokenizer.from_pretrained(directory)


def stored_params(config, scalar_head: bool) -> dict:
  """The weights at `load_parameters_path` as MaxText's params dict, read into the model this config builds (with a
  reward model's scalar head): a checkpoint of another shape fails naming the path and the difference."""
  spec = roles.RoleSpec("exported", trained=False, head="scalar" if scalar_head else "lm")
  model = roles.build_frozen(spec, config, mesh_lib.make_mesh(config))
  return nnx.State(model.state).filter(nnx.Param).to_pure_dict()


def hf_weights(config, params: dict, hf) -> dict[str, np.ndarray]:
  """Hugging Face tensor name -> array of MaxText's params dict, by MaxText's mappings and hooks for the family."""
  hf_dict = hf.to_dict()
  mapping, hooks, rotates_halves = hf_families.mappings(config, hf_dict, saving_to_hf=True)
  shapes = hf_shape.HF_SHAPE[hf_families.FAMILIES[hf_families.block(config)][0]](hf_dict)
  head = params.pop(forward.SCALAR_HEAD, None)
  state = conversion.extract_linen_weights(params)
  if rotates_halves:
    state = {k: hf_families.as_interleaved(v) if k.endswith(hf_families.ROTATED) else v for k, v in state.items()}
  weights = {}
  for key in conversion.validate_and_filter_param_map_keys(mapping, set(state)):
    weights.update(conversion.process_maxtext_param(key, state[key], mapping, hooks, shapes, config))
  if head is not None:  # MaxText's DenseGeneral kernel [emb, 1] is score.weight [1, emb]
    weights = {k: v for k, v in weights.items() if not k.startswith("lm_head")}
    weights[_SCORE] = conversion.convert_jax_weight_to_numpy(head["kernel"], str(np.dtype(config.weight_dtype))).T
  return weights


def export(config, output: str) -> str:
  """Writes `load_parameters_path`'s model to `output` as a Hugging Face checkpoint; returns `output`."""
  config_class = check_exportable(config)[1]
  if not config.load_parameters_path:
    raise config_lib.ConfigError("hf_export reads load_parameters_path: set it to a checkpoint's <step>/items.")
  scalar_head = forward.has_scalar_head(checkpoint_guard.stored_params(config.load_parameters_path))
  local = not output.startswith(("gs://", "hf://"))
  if scalar_head and not local:
    raise config_lib.ConfigError(f"--hf_path={output}: a reward model is written to a local directory (then copied).")
  tokenizer = hf_tokenizer(config, scalar_head)
  source = source_config(config, config_class)
  hf = hf_config(config, tokenizer, scalar_head, source)
  architectures = hf.architectures
  weights = hf_weights(config, stored_params(config, scalar_head), hf)
  count = len(weights)
  conversion.save_model_files(weights, hf, tokenizer, None, output)
  generation = os.path.join(config.tokenizer_path, _GENERATION_CONFIG)
  if jax.process_index() == 0 and scalar_head:  # MaxText's writer names the family's CausalLM architecture
    hf.architectures = architectures
    hf.to_json_file(os.path.join(output, "config.json"))
  elif jax.process_index() == 0 and local and same_model(config, source) and os.path.isfile(generation):
    shutil.copy(generation, os.path.join(output, _GENERATION_CONFIG))
  max_logging.log(f"Wrote {architectures[0]} ({count} tensors) from {config.load_parameters_path} to {output}")
  return output


def main(argv: list[str]) -> None:
  export(config_lib.initialize(list(argv)), hf_families.HF_PATH.value)


if __name__ == "__main__":
  cli.run(main)

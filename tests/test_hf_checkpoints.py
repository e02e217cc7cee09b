"""Hugging Face export: the written checkpoint computes what the trained MaxText model computes.

The reference is a numpy implementation of Hugging Face's Llama and Qwen3 (transformers' modeling_llama.py and
modeling_qwen3.py: RMSNorm, rotate-half RoPE with the config's theta, grouped-query attention scaled by 1/sqrt(head_dim),
Qwen3's per-head q/k norms, SwiGLU, the LM head or `score` at the last non-padding token), reading only the written
config.json and safetensors: no MaxText code, and no torch (not installed)."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import sentencepiece
import transformers
from flax import nnx
from safetensors import numpy as safetensors_numpy

from maxtext_posttrain import config as config_lib
from maxtext_posttrain import forward
from maxtext_posttrain import hf_export
from maxtext_posttrain import hf_import
from maxtext_posttrain import mesh as mesh_lib
from maxtext_posttrain import roles
from maxtext_posttrain.data import arithmetic
from tests import run_utils

QWEN3 = (
    "decoder_block=qwen3", "use_qk_norm=true", "logits_via_embedding=true", "normalize_embedding_logits=false",
    "normalization_layer_epsilon=1.e-6", "rope_max_timescale=1000000", "base_num_kv_heads=2",
)  # fmt: skip


def _rms(x, weight, eps):
  return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _rope(x, theta):
  """Rotate-half RoPE of [T, heads, d] at positions 0..T-1 (transformers' apply_rotary_pos_emb)."""
  d = x.shape[-1]
  angles = np.arange(x.shape[0])[:, None] / theta ** (np.arange(0, d, 2) / d)[None, :]
  cos, sin = np.cos(np.concatenate([angles] * 2, -1))[:, None], np.sin(np.concatenate([angles] * 2, -1))[:, None]
  rotated = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
  return x * cos + rotated * sin


def hf_model(directory, tokens: np.ndarray, tied_head_in_bfloat16: bool = False) -> np.ndarray:
  """[T, vocab] logits of a ForCausalLM checkpoint, or [1] the score of a ForSequenceClassification one, on one
  row of token ids (float64). `tied_head_in_bfloat16` rounds the embedding table to bfloat16 for the tied LM head
  only, as MaxText's `attend_on_embedding` does (Hugging Face's head reads it in float32)."""
  config = json.loads((directory / "config.json").read_text())
  w = {}
  for file in directory.glob("*.safetensors"):
    w |= {k: v.astype(np.float64) for k, v in safetensors_numpy.load_file(file).items()}
  eps, d = config["rms_norm_eps"], config["head_dim"]
  heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
  theta = config["rope_parameters"]["rope_theta"]
  length = len(tokens)
  x = w["model.embed_tokens.weight"][tokens]
  causal = np.tril(np.ones((length, length), bool))
  for i in range(config["num_hidden_layers"]):
    layer = lambda name: w[f"model.layers.{i}.{name}"]  # pylint: disable=cell-var-from-loop
    h = _rms(x, layer("input_layernorm.weight"), eps)
    q = (h @ layer("self_attn.q_proj.weight").T).reshape(length, heads, d)
    k = (h @ layer("self_attn.k_proj.weight").T).reshape(length, kv_heads, d)
    v = (h @ layer("self_attn.v_proj.weight").T).reshape(length, kv_heads, d)
    if config["model_type"] == "qwen3":
      q, k = _rms(q, layer("self_attn.q_norm.weight"), eps), _rms(k, layer("self_attn.k_norm.weight"), eps)
    q, k = _rope(q, theta), _rope(k, theta)
    k, v = np.repeat(k, heads // kv_heads, axis=1), np.repeat(v, heads // kv_heads, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
    scores = np.where(causal[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    x = x + np.einsum("hqk,khd->qhd", probs, v).reshape(length, heads * d) @ layer("self_attn.o_proj.weight").T
    h = _rms(x, layer("post_attention_layernorm.weight"), eps)
    gate, up = h @ layer("mlp.gate_proj.weight").T, h @ layer("mlp.up_proj.weight").T
    x = x + (gate / (1 + np.exp(-gate)) * up) @ layer("mlp.down_proj.weight").T
  x = _rms(x, w["model.norm.weight"], eps)
  if "score.weight" in w:
    last = np.flatnonzero(tokens != config["pad_token_id"])[-1]
    return x[last] @ w["score.weight"].T
  if not config["tie_word_embeddings"]:
    return x @ w["lm_head.weight"].T
  head = w["model.embed_tokens.weight"]
  return x @ (head.astype(ml_dtypes.bfloat16).astype(np.float64) if tied_head_in_bfloat16 else head).T


def _question_tokens(config, pad: int = 0) -> np.ndarray:
  tokenizer = hf_export.hf_tokenizer(config)
  problem = arithmetic.generate("easy", "test", 1, seed=3)[0]
  text = f"Question: {problem['question']}\nAnswer: {problem['answer']}"
  return np.array(tokenizer(text)["input_ids"] + [tokenizer.pad_token_id] * pad)


def _maxtext_outputs(config, tokens: np.ndarray, scalar_head: bool) -> np.ndarray:
  """The MaxText model's own logits (or scalar values) on one row, loaded as hf_export loads it."""
  spec = roles.RoleSpec("exported", trained=False, head="scalar" if scalar_head else "lm")
  model = roles.build_frozen(spec, config, mesh_lib.make_mesh(config))
  inputs = jnp.asarray(tokens)[None]
  positions, segmentation = jnp.arange(len(tokens))[None], jnp.ones_like(inputs)
  call = forward.scalars if scalar_head else forward.logits
  return np.asarray(jax.device_get(model.run(call, inputs, positions, segmentation)), np.float64)[0]


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory, tfds_dir):
  """A 2-step SFT run of a tiny Qwen3-shaped MaxText model (tied embeddings, q/k norms, 2 KV heads for 4 queries)."""
  out = tmp_path_factory.mktemp("qwen3")
  argv = ["", "sft.yml", "run_name=q", f"base_output_directory={out}", f"dataset_path={tfds_dir}", *QWEN3]
  argv += [run_utils.SHORT_TRAIN_SPLIT, "steps=2", "eval_interval=0", "checkpoint_period=1", "async_checkpointing=false"]
  run_utils.run(config_lib.initialize(argv))
  return out / "q" / "checkpoints" / "1" / "items"


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_exported_causal_lm_computes_the_trained_models_logits(
    family, make_config, sft_checkpoint, qwen3_checkpoint, tmp_path
):
  """The 200-step SFT model (MaxText's llama2 block) and a Qwen3-shaped one, exported, give the MaxText model's
  logits under the numpy Hugging Face reference (1e-4 of their spread; for the tied head with MaxText's bfloat16
  table, see `hf_model`); transformers reads the config and the tokenizer, which encodes as the run's does."""
  checkpoint = sft_checkpoint if family == "llama" else qwen3_checkpoint
  config = make_config(*(QWEN3 if family == "qwen3" else ()), f"load_parameters_path={checkpoint}")
  out = tmp_path / "hf"
  hf_export.export(config, str(out))

  hf = transformers.AutoConfig.from_pretrained(out)
  assert hf.model_type == family and hf.architectures == [f"{'Llama' if family == 'llama' else 'Qwen3'}ForCausalLM"]
  assert hf.tie_word_embeddings == (family == "qwen3") and hf.vocab_size == config.vocab_size
  tokens = _question_tokens(config)
  pieces = sentencepiece.SentencePieceProcessor(model_file=config.tokenizer_path)
  assert list(tokens) == [pieces.bos_id()] + pieces.encode(pieces.decode(list(tokens[1:])))
  assert transformers.AutoTokenizer.from_pretrained(out)(pieces.decode(list(tokens[1:])))["input_ids"] == list(tokens)
  expected = _maxtext_outputs(config, tokens, scalar_head=False)
  got = hf_model(out, tokens, tied_head_in_bfloat16=hf.tie_word_embeddings)
  assert got.shape == expected.shape == (len(tokens), config.vocab_size)
  np.testing.assert_allclose(got, expected, atol=1e-4 * np.ptp(expected))
  assert (got.argmax(-1) == expected.argmax(-1)).mean() > 0.95


def test_a_reward_model_exports_as_sequence_classification_scoring_the_last_token(make_config, sft_checkpoint, tmp_path):
  """A reward model (2 Bradley-Terry steps from the SFT model: a non-zero head) becomes LlamaForSequenceClassification
  with one label and no LM head; its `score` at the last non-padding token is the MaxText reward model's value at
  the row's last token."""
  run = make_config(
      f"load_parameters_path={sft_checkpoint}", "steps=2", "eval_interval=0", "checkpoint_period=1",
      "async_checkpointing=false", config_file="reward_model.yml",
  )  # fmt: skip
  run_utils.run(run)
  config = make_config(f"load_parameters_path={run.checkpoint_dir}1/items", config_file="reward_model.yml")
  out = tmp_path / "hf"
  hf_export.export(config, str(out))

  hf = transformers.AutoConfig.from_pretrained(out)
  assert hf.architectures == ["LlamaForSequenceClassification"] and hf.num_labels == 1
  stored = safetensors_numpy.load_file(out / "model.safetensors")
  assert stored["score.weight"].shape == (1, config.emb_dim) and not any(k.startswith("lm_head") for k in stored)
  assert np.abs(stored["score.weight"]).max() > 0
  tokens = _question_tokens(config, pad=5)
  length = len(tokens) - 5
  expected = _maxtext_outputs(config, tokens[:length], scalar_head=True)[-1]
  np.testing.assert_allclose(hf_model(out, tokens), [expected], rtol=1e-4, atol=1e-6)


def test_models_outside_the_families_are_refused_in_one_line(make_config, sft_checkpoint):
  with pytest.raises(config_lib.ConfigError, match="decoder_block=mistral: hf_export writes"):
    hf_export.hf_config(make_config("decoder_block=mistral"), None, False)
  with pytest.raises(config_lib.ConfigError, match="mlp_activations=\\['gelu', 'linear'\\]"):
    hf_export.hf_config(make_config("mlp_activations=[gelu,linear]"), None, False)
  with pytest.raises(config_lib.ConfigError, match="hf_export reads load_parameters_path"):
    hf_export.export(make_config(), "/nonexistent")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_an_exported_checkpoint_reads_back_into_the_same_weights(
    family, make_config, sft_checkpoint, qwen3_checkpoint, tmp_path, tfds_dir
):
  """hf_import of hf_export's output gives back every weight of the trained checkpoint (to float32's last bit: MaxText's
  llama hooks scale the query kernel by sqrt(head_dim) on the way out and by its inverse on the way back), and the
  keys that build the same model with the exported tokenizer."""
  checkpoint = sft_checkpoint if family == "llama" else qwen3_checkpoint
  config = make_config(*(QWEN3 if family == "qwen3" else ()), f"load_parameters_path={checkpoint}")
  hf_export.export(config, str(tmp_path / "hf"))
  argv = ["", "sft.yml", "run_name=r", f"base_output_directory={tmp_path}", f"dataset_path={tfds_dir}"]
  keys = hf_import.import_checkpoint(argv, str(tmp_path / "hf"), str(tmp_path / "mt"))
  assert keys[0] == f"load_parameters_path={tmp_path / 'mt' / 'items'}"
  assert f"tokenizer_path={tmp_path / 'hf'}" in keys and "tokenizer_type=huggingface" in keys
  original = roles.build_frozen(roles.RoleSpec("a", trained=False), config, mesh_lib.make_mesh(config)).state
  original = original.filter(nnx.Param)
  read = config_lib.initialize([*argv, *keys])
  assert (read.emb_dim, read.num_kv_heads, read.logits_via_embedding) == (
      config.emb_dim,
      config.num_kv_heads,
      config.logits_via_embedding,
  )
  imported = roles.build_frozen(roles.RoleSpec("b", trained=False), read, mesh_lib.make_mesh(read)).state
  imported = imported.filter(nnx.Param)
  flat_original, flat_imported = jax.tree.leaves(original), jax.tree.leaves(imported)
  assert len(flat_original) == len(flat_imported) > 0
  for a, b in zip(flat_original, flat_imported):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=3e-7, atol=0)


def _random_llama(directory, rng) -> None:
  """A Hugging Face Llama checkpoint written with numpy: bfloat16 weights in two safetensors shards and their index,
  grouped-query attention (4 queries, 2 KV heads), an untied LM head, RoPE theta 50,000, no tokenizer."""
  config = transformers.LlamaConfig(
      vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=50000.0, tie_word_embeddings=False,
  )  # fmt: skip
  config.save_pretrained(directory)
  shapes = {"model.embed_tokens.weight": (96, 64), "model.norm.weight": (64,), "lm_head.weight": (96, 64)}
  for i in range(2):
    shapes |= {
        f"model.layers.{i}.input_layernorm.weight": (64,), f"model.layers.{i}.post_attention_layernorm.weight": (64,),
        f"model.layers.{i}.self_attn.q_proj.weight": (64, 64), f"model.layers.{i}.self_attn.k_proj.weight": (32, 64),
        f"model.layers.{i}.self_attn.v_proj.weight": (32, 64), f"model.layers.{i}.self_attn.o_proj.weight": (64, 64),
        f"model.layers.{i}.mlp.gate_proj.weight": (96, 64), f"model.layers.{i}.mlp.up_proj.weight": (96, 64),
        f"model.layers.{i}.mlp.down_proj.weight": (64, 96),
    }  # fmt: skip
  tensors = {
      name: (
          1.0 + 0.1 * rng.standard_normal(shape) if name.endswith("norm.weight") else 0.2 * rng.standard_normal(shape)
      ).astype(ml_dtypes.bfloat16)
      for name, shape in shapes.items()
  }
  names = sorted(tensors)
  shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
  for file, shard in shards.items():
    safetensors_numpy.save_file({name: tensors[name] for name in shard}, directory / file)
  index = {"metadata": {}, "weight_map": {name: file for file, shard in shards.items() for name in shard}}
  (directory / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("scan_layers", [True, False])
def test_a_hugging_face_llama_reads_into_a_maxtext_model_with_its_logits(scan_layers, tmp_path, tfds_dir):
  """A Llama checkpoint written outside this project (bfloat16 shards, GQA, untied head) reads into a MaxText model,
  its layers scanned or not, whose logits are the numpy Hugging Face reference's on the same weights."""
  hf = tmp_path / "hf"
  hf.mkdir()
  _random_llama(hf, np.random.default_rng(0))
  argv = ["", "sft.yml", "run_name=r", f"base_output_directory={tmp_path}", f"dataset_path={tfds_dir}"]
  argv.append(f"scan_layers={str(scan_layers).lower()}")
  keys = hf_import.import_checkpoint(argv, str(hf), str(tmp_path / "mt"))
  assert not any(k.startswith("tokenizer") for k in keys)
  config = config_lib.initialize([*argv, *keys])
  assert (config.num_kv_heads, config.vocab_size, config.rope_max_timescale) == (2, 96, 50000)
  tokens = np.random.default_rng(1).integers(0, 96, 24)
  expected = hf_model(hf, tokens)
  got = _maxtext_outputs(config, tokens, scalar_head=False)
  np.testing.assert_allclose(got, expected, atol=1e-4 * np.ptp(expected))


def test_checkpoints_outside_the_families_are_refused_naming_the_file(tmp_path):
  transformers.MistralConfig(sliding_window=None).save_pretrained(tmp_path)
  with pytest.raises(config_lib.ConfigError, match=f"{tmp_path}/config.json: model_type=mistral; hf_import reads"):
    hf_import.model_keys(str(tmp_path))
  transformers.LlamaConfig(attention_bias=True).save_pretrained(tmp_path)
  with pytest.raises(config_lib.ConfigError, match="config.json: attention_bias=True is not read by hf_import"):
    hf_import.model_keys(str(tmp_path))

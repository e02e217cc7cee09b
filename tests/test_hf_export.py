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
from safetensors import numpy as safetensors_numpy

from maxtext_posttrain import config as config_lib
from maxtext_posttrain import forward
from maxtext_posttrain import hf_export
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
  w = {k: v.astype(np.float64) for k, v in safetensors_numpy.load_file(directory / "model.safetensors").items()}
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

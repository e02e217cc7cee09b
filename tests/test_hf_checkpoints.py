"""Hugging Face checkpoints in and out: what is written computes what the trained MaxText model computes, and what is
read computes what the Hugging Face checkpoint does.

The reference is a numpy implementation of Hugging Face's Llama and Qwen3 (transformers' modeling_llama.py,
modeling_qwen3.py and modeling_rope_utils.py: RMSNorm, rotate-half RoPE with the config's theta and, for
rope_type=llama3, its frequency scaling, grouped-query attention scaled by 1/sqrt(head_dim), Qwen3's per-head q/k
norms, SwiGLU, the LM head or `score` at the last non-padding token), reading only a checkpoint's config.json and
safetensors: no MaxText code, and no torch (not installed)."""

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
from maxtext_posttrain import hf_families
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


def _inverse_frequencies(rope: dict, d: int) -> np.ndarray:
  """transformers' default inv_freq, and `_compute_llama3_parameters`'s scaling of it for rope_type=llama3."""
  inv_freq = 1.0 / rope["rope_theta"] ** (np.arange(0, d, 2) / d)
  if rope["rope_type"] == "default":
    return inv_freq
  assert rope["rope_type"] == "llama3", rope
  factor, low, high, old = (
      rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
  )
  wavelen = 2 * np.pi / inv_freq
  scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
  smooth = (old / wavelen - low) / (high - low)
  medium = (wavelen >= old / high) & (wavelen <= old / low)
  return np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def _rope(x, rope: dict):
  """Rotate-half RoPE of [T, heads, d] at positions 0..T-1 (transformers' apply_rotary_pos_emb)."""
  d = x.shape[-1]
  angles = np.arange(x.shape[0])[:, None] * _inverse_frequencies(rope, d)[None, :]
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
  rope = config["rope_parameters"]
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
    q, k = _rope(q, rope), _rope(k, rope)
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


def _question_text() -> str:
  problem = arithmetic.generate("easy", "test", 1, seed=3)[0]
  return f"Question: {problem['question']}\nAnswer: {problem['answer']}"


def _maxtext_outputs(config, tokens: np.ndarray, scalar_head: bool) -> np.ndarray:
  """The MaxText model's own logits (or scalar values) on one row, loaded as hf_export loads it."""
  spec = roles.RoleSpec("exported", trained=False, head="scalar" if scalar_head else "lm")
  model = roles.build_frozen(spec, config, mesh_lib.make_mesh(config))
  inputs = jnp.asarray(tokens)[None]
  positions, segmentation = jnp.arange(len(tokens))[None], jnp.ones_like(inputs)
  call = forward.scalars if scalar_head else forward.logits
  return np.asarray(jax.device_get(model.run(call, inputs, positions, segmentation)), np.float64)[0]


# Model keys of the exported models besides the 200-step SFT model (MaxText's llama2 block, default RoPE, 4 KV heads).
MODELS = {
    "llama": (),
    "llama3.1": ("rope_type=llama3.1", "base_num_kv_heads=2"),  # LLaMARotaryEmbedding (interleaved, scaled), GQA
    "qwen3": QWEN3,
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tfds_dir, sft_checkpoint):
  """The trained checkpoint of each of MODELS: besides the SFT model, 2 SFT steps of each other shape."""
  paths = {"llama": sft_checkpoint}
  for name, keys in MODELS.items():
    if keys:
      out = tmp_path_factory.mktemp(name)
      argv = ["", "sft.yml", "run_name=r", f"base_output_directory={out}", f"dataset_path={tfds_dir}", *keys]
      argv += [run_utils.SHORT_TRAIN_SPLIT, "steps=2", "eval_interval=0", "checkpoint_period=1"]
      run_utils.run(config_lib.initialize([*argv, "async_checkpointing=false"]))
      paths[name] = out / "r" / "checkpoints" / "1" / "items"
  return paths


@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_exported_causal_lm_computes_the_trained_models_logits(model, make_config, checkpoints, tmp_path):
  """The 200-step SFT model (MaxText's llama2 block, default RoPE), a Llama 3.1-RoPE one (MaxText's interleaved,
  scaled LLaMARotaryEmbedding; 2 KV heads for 4 queries) and a Qwen3-shaped one (tied embeddings, q/k norms, GQA),
  exported, give the MaxText model's logits under the numpy Hugging Face reference (1e-4 of their spread; for the tied
  head with MaxText's bfloat16 table, see `hf_model`); transformers reads the config, and the tokenizer encodes as
  the run's sentencepiece model does."""
  config = make_config(*MODELS[model], f"load_parameters_path={checkpoints[model]}")
  out = tmp_path / "hf"
  hf_export.export(config, str(out))

  hf = transformers.AutoConfig.from_pretrained(out)
  family = "qwen3" if model == "qwen3" else "llama"
  assert hf.model_type == family and hf.architectures == [f"{'Qwen3' if model == 'qwen3' else 'Llama'}ForCausalLM"]
  assert hf.tie_word_embeddings == (model == "qwen3") and hf.vocab_size == config.vocab_size
  assert hf.rope_parameters["rope_type"] == ("llama3" if model == "llama3.1" else "default")
  pieces = sentencepiece.SentencePieceProcessor(model_file=config.tokenizer_path)
  tokens = np.array(transformers.AutoTokenizer.from_pretrained(out)(_question_text())["input_ids"])
  assert list(tokens) == [pieces.bos_id()] + pieces.encode(_question_text())
  leading = transformers.AutoTokenizer.from_pretrained(out)(" 19")["input_ids"]  # the dummy prefix takes the space
  assert leading == [pieces.bos_id()] + pieces.encode(" 19")[1:] != [pieces.bos_id()] + pieces.encode(" 19")
  assert hf.max_position_embeddings == (8192 if model == "llama3.1" else config.max_target_length)
  expected = _maxtext_outputs(config, tokens, scalar_head=False)
  got = hf_model(out, tokens, tied_head_in_bfloat16=hf.tie_word_embeddings)
  assert got.shape == expected.shape == (len(tokens), config.vocab_size)
  np.testing.assert_allclose(got, expected, atol=1e-4 * np.ptp(expected))
  assert (got.argmax(-1) == expected.argmax(-1)).mean() > 0.95


def test_a_reward_model_exports_as_sequence_classification_scoring_the_last_token(make_config, sft_checkpoint, tmp_path):
  """A reward model (2 Bradley-Terry steps from the SFT model: a non-zero head) becomes LlamaForSequenceClassification
  with one label and no LM head; its tokenizer (made from sentencepiece, or a Hugging Face one) ends a text with EOS
  as the reward model's rows end, and its `score` at the last non-padding token of a padded row is the MaxText reward
  model's value at the row's last token."""
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
  tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  row = tokenizer(_question_text())["input_ids"]  # BOS, the text and EOS, as the reward model's rows end
  assert row[0] == tokenizer.bos_token_id and row[-1] == tokenizer.eos_token_id != tokenizer.pad_token_id
  expected = _maxtext_outputs(config, np.array(row), scalar_head=True)[-1]
  padded = np.array(row + [tokenizer.pad_token_id] * 5)
  np.testing.assert_allclose(hf_model(out, padded), [expected], rtol=1e-4, atol=1e-6)

  # With a Hugging Face tokenizer (here an exported language model's, which adds no EOS of its own) the reward
  # model's tokenizer adds EOS too; one whose padding token is EOS is refused.
  hf_export.export(make_config(f"load_parameters_path={sft_checkpoint}"), str(tmp_path / "lm"))
  keys = ("tokenizer_type=huggingface", f"tokenizer_path={tmp_path / 'lm'}")
  tokenizer = hf_export.hf_tokenizer(make_config(*keys, config_file="reward_model.yml"), scalar_head=True)
  assert tokenizer(_question_text())["input_ids"] == row
  settings = json.loads((tmp_path / "lm" / "tokenizer_config.json").read_text())
  (tmp_path / "lm" / "tokenizer_config.json").write_text(json.dumps(settings | {"pad_token": settings["eos_token"]}))
  with pytest.raises(config_lib.ConfigError, match="needs a padding token other than EOS"):
    hf_export.hf_tokenizer(make_config(*keys, config_file="reward_model.yml"), scalar_head=True)


def test_what_hugging_face_cannot_say_is_refused_in_one_line(make_config, tmp_path):
  """Models outside the families, keys their configs cannot express, a LoRA run (merged by peft.export first), no
  checkpoint, and a sentencepiece model whose normaliser a Hugging Face Llama tokenizer would not reproduce."""
  refused = {
      ("decoder_block=mistral",): "decoder_block=mistral: hf_export writes",
      ("mlp_activations=[gelu,linear]",): "mlp_activations=\\['gelu', 'linear'\\]",
      ("rope_linear_scaling_factor=2.0",): "rope_linear_scaling_factor=2.0: the Hugging Face families here need",
      ("rope_type=yarn",): "rope_type=yarn: the Hugging Face families here use default or llama3.1",
      ("decoder_block=qwen3", "use_qk_norm=true", "rope_type=llama3.1"): "Llama 3.1's RoPE belongs to",
      ("fused_qkv=true",): "fused_qkv=True: not expressible in Llama's config",
      ("attn_logits_soft_cap=50.0",): "attn_logits_soft_cap=50.0: not expressible",
      ("sliding_window_size=16",): "sliding_window_size=16: not expressible",
      ("num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=512"): "num_experts=4: not expressible",
      ("logits_via_embedding=true", "final_logits_soft_cap=30.0"): "tied LM head neither scales nor caps its logits",
      ("rope_min_timescale=2",): "rope_min_timescale=2: the Hugging Face families here need",
      ("quantization=int8",): "quantization=int8: the Hugging Face families here need",
      ("lora.enable_lora=true",): "adapters merge into a full checkpoint with `python -m maxtext_posttrain.peft.export`",
  }
  for keys, message in refused.items():
    with pytest.raises(config_lib.ConfigError, match=message):
      hf_export.check_exportable(make_config(*keys))
  with pytest.raises(config_lib.ConfigError, match="hf_export reads load_parameters_path"):
    hf_export.export(make_config(), "/nonexistent")
  text = "\n".join(["Question: 3 + 4 =", "Answer:  7", "two  spaces here"] * 50)
  (tmp_path / "corpus.txt").write_text(text)
  sentencepiece.SentencePieceTrainer.train(
      input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "nfkc"), vocab_size=28, model_type="unigram"
  )  # the default normaliser: spaces collapsed
  with pytest.raises(config_lib.ConfigError, match="as a Hugging Face tokenizer it encodes"):
    hf_export.hf_tokenizer(make_config(f"tokenizer_path={tmp_path / 'nfkc.model'}", "vocab_size=28"))


def test_the_config_beside_a_hugging_face_tokenizer_gives_the_token_ids_and_of_the_same_model_its_context(
    make_config, sft_checkpoint, tmp_path
):
  """Exported with its tokenizer read from a Hugging Face directory, a model's config.json starts from the config
  there: the token ids (an EOS list) stay; shapes, RoPE and dtype are the run's; the context length and
  generation_config.json stay only when that config describes the same model."""
  config = make_config(f"load_parameters_path={sft_checkpoint}")
  hf_export.export(config, str(tmp_path / "source"))
  source = json.loads((tmp_path / "source" / "config.json").read_text())
  (tmp_path / "source" / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 5], "top_p": 0.9}))
  keys = ("tokenizer_type=huggingface", f"tokenizer_path={tmp_path / 'source'}", f"load_parameters_path={sft_checkpoint}")

  same = source | {"max_position_embeddings": 4096, "eos_token_id": [3, 5]}
  (tmp_path / "source" / "config.json").write_text(json.dumps(same))
  hf_export.export(make_config(*keys), str(tmp_path / "same"))
  written = json.loads((tmp_path / "same" / "config.json").read_text())
  assert written["max_position_embeddings"] == 4096 and written["eos_token_id"] == [3, 5]
  assert json.loads((tmp_path / "same" / "generation_config.json").read_text())["top_p"] == 0.9

  other = same | {"hidden_size": 4096, "num_hidden_layers": 32, "torch_dtype": "bfloat16", "mlp_bias": True}
  other |= {"rope_theta": 500000.0, "rope_scaling": LLAMA3, "max_position_embeddings": 131072}
  other.pop("rope_parameters")
  other.pop("dtype")
  (tmp_path / "source" / "config.json").write_text(json.dumps(other))
  hf_export.export(make_config(*keys), str(tmp_path / "other"))
  written = json.loads((tmp_path / "other" / "config.json").read_text())
  assert written["eos_token_id"] == [3, 5] and not (tmp_path / "other" / "generation_config.json").exists()
  for key in ("hidden_size", "num_hidden_layers", "rope_parameters", "dtype", "mlp_bias", "vocab_size"):
    assert written[key] == source[key], key
  assert written["max_position_embeddings"] == config.max_target_length and "rope_scaling" not in written


@pytest.mark.parametrize("model", sorted(MODELS))
def test_an_exported_checkpoint_reads_back_into_the_same_weights(model, make_config, checkpoints, tmp_path, tfds_dir):
  """hf_import of hf_export's output gives back every weight of the trained checkpoint (to float32's last bit: MaxText's
  llama hooks scale the query kernel by sqrt(head_dim) on the way out and by its inverse on the way back), with keys
  that build the same model (its RoPE included) and the exported tokenizer; exported again, it is the same Hugging
  Face checkpoint (the config read from beside the tokenizer, as for an imported model)."""
  config = make_config(*MODELS[model], f"load_parameters_path={checkpoints[model]}")
  hf_export.export(config, str(tmp_path / "hf"))
  argv = ["", "sft.yml", "run_name=r", f"base_output_directory={tmp_path}", f"dataset_path={tfds_dir}"]
  keys = hf_import.import_checkpoint(argv, str(tmp_path / "hf"), str(tmp_path / "mt"))
  assert keys[0] == f"load_parameters_path={tmp_path / 'mt' / 'items'}"
  assert f"tokenizer_path={tmp_path / 'hf'}" in keys and "tokenizer_type=huggingface" in keys
  read = config_lib.initialize([*argv, *keys])
  for key in ("emb_dim", "num_kv_heads", "logits_via_embedding", "rope_max_timescale", "use_qk_norm"):
    assert getattr(read, key) == getattr(config, key), key
  assert hf_families.rope_parameters(read) == hf_families.rope_parameters(config)
  original, imported = (
      roles.build_frozen(roles.RoleSpec(name, trained=False), c, mesh_lib.make_mesh(c)).state.filter(nnx.Param)
      for name, c in (("original", config), ("imported", read))
  )
  assert jax.tree.structure(original) == jax.tree.structure(imported)
  for a, b in zip(jax.tree.leaves(original), jax.tree.leaves(imported)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=3e-7, atol=0)

  hf_export.export(config_lib.initialize([*argv, *keys]), str(tmp_path / "again"))
  first, again = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("hf", "again"))
  assert again == first
  first, again = (safetensors_numpy.load_file(tmp_path / d / "model.safetensors") for d in ("hf", "again"))
  assert sorted(again) == sorted(first)
  for name, value in first.items():
    np.testing.assert_allclose(again[name], value, rtol=3e-7, atol=0, err_msg=name)


def _random_llama(directory, rng, rope_scaling) -> None:
  """A Hugging Face Llama checkpoint written with numpy: bfloat16 weights in two safetensors shards and their index,
  grouped-query attention (4 queries, 2 KV heads), an untied LM head, RoPE theta 50,000 (with `rope_scaling`), no
  tokenizer."""
  config = transformers.LlamaConfig(
      vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=50000.0, tie_word_embeddings=False,
      rope_scaling=rope_scaling,
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


LLAMA3 = {"rope_type": "llama3", **hf_families.LLAMA3_SCALING}


@pytest.mark.parametrize("scan_layers,rope_scaling", [(True, None), (False, None), (True, LLAMA3)])
def test_a_hugging_face_llama_reads_into_a_maxtext_model_with_its_logits(scan_layers, rope_scaling, tmp_path, tfds_dir):
  """A Llama checkpoint written outside this project (bfloat16 shards, GQA, untied head; default RoPE or Llama 3's
  scaling, which MaxText runs as LLaMARotaryEmbedding) reads into a MaxText model, its layers scanned or not, whose
  logits are the numpy Hugging Face reference's on the same weights."""
  hf = tmp_path / "hf"
  hf.mkdir()
  _random_llama(hf, np.random.default_rng(0), rope_scaling)
  argv = ["", "sft.yml", "run_name=r", f"base_output_directory={tmp_path}", f"dataset_path={tfds_dir}"]
  argv.append(f"scan_layers={str(scan_layers).lower()}")
  keys = hf_import.import_checkpoint(argv, str(hf), str(tmp_path / "mt"))
  assert not any(k.startswith("tokenizer") for k in keys)
  config = config_lib.initialize([*argv, *keys])
  assert (config.num_kv_heads, config.vocab_size, config.rope_max_timescale) == (2, 96, 50000)
  assert hf_families.llama31_rope(config) == (rope_scaling is not None)
  tokens = np.random.default_rng(1).integers(0, 96, 24)
  expected = hf_model(hf, tokens)
  got = _maxtext_outputs(config, tokens, scalar_head=False)
  np.testing.assert_allclose(got, expected, atol=1e-4 * np.ptp(expected))


def test_checkpoints_outside_the_families_are_refused_naming_the_file(tmp_path):
  transformers.MistralConfig(sliding_window=None).save_pretrained(tmp_path)
  with pytest.raises(config_lib.ConfigError, match=f"{tmp_path}/config.json: model_type=mistral; hf_import reads"):
    hf_import.model_keys(str(tmp_path))
  for unsupported in ({"attention_bias": True}, {"mlp_bias": True}, {"hidden_act": "gelu"}):
    transformers.LlamaConfig(**unsupported).save_pretrained(tmp_path)
    key, value = next(iter(unsupported.items()))
    with pytest.raises(config_lib.ConfigError, match=f"config.json: {key}={value} is not read by hf_import"):
      hf_import.model_keys(str(tmp_path))
  transformers.Qwen3Config(use_sliding_window=True, sliding_window=64).save_pretrained(tmp_path)
  with pytest.raises(config_lib.ConfigError, match="config.json: use_sliding_window=True is not read by hf_import"):
    hf_import.model_keys(str(tmp_path))
  quantized = {"quant_method": "bitsandbytes", "load_in_8bit": True}
  transformers.LlamaConfig(quantization_config=quantized).save_pretrained(tmp_path)
  with pytest.raises(config_lib.ConfigError, match="quantization_config=.*is not read by hf_import"):
    hf_import.model_keys(str(tmp_path))
  safetensors_numpy.save_file({"w": np.ones((2, 2), np.int8)}, tmp_path / "model.safetensors")
  with pytest.raises(config_lib.ConfigError, match="model.safetensors: w is int8; hf_import reads"):
    hf_import._tensor_getter(str(tmp_path))("w")  # pylint: disable=protected-access


def test_a_training_config_that_runs_another_rope_is_refused(make_config, tmp_path):
  """The training config's own keys may set a RoPE other than the checkpoint's (a model_name of MaxText's Llama 3.1,
  say), and a Llama 3 scaling other than MaxText's (Llama 3.2's factor 32) reads as MaxText's: the import names the
  difference before writing anything."""
  transformers.LlamaConfig(head_dim=32, hidden_size=128, num_attention_heads=4).save_pretrained(tmp_path)
  with pytest.raises(config_lib.ConfigError, match="its RoPE differs from the one this config runs"):
    hf_import.check_rope(make_config("rope_type=llama3.1"), str(tmp_path))
  hf_import.check_rope(make_config(), str(tmp_path))
  transformers.LlamaConfig(rope_scaling=LLAMA3 | {"factor": 32.0}).save_pretrained(tmp_path)  # Llama 3.2's
  assert "rope_type=llama3.1" in hf_import.model_keys(str(tmp_path))  # the keys of MaxText's Llama 3.1 RoPE ...
  with pytest.raises(config_lib.ConfigError, match="'factor': \\(8.0, 32.0\\)"):  # ... which scales by 8
    hf_import.check_rope(make_config("rope_type=llama3.1"), str(tmp_path))

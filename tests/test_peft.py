"""LoRA and QLoRA through the generic loop: only adapters train, adapter checkpoints resume exactly, and the export
merges them into a checkpoint that plain MaxText loads."""

import jax
import numpy as np
import pytest
from flax import nnx

from maxtext.utils import maxtext_utils
from maxtext.utils import model_creation_utils
from maxtext_posttrain import config as posttrain_config
from maxtext_posttrain import trainer
from maxtext_posttrain.peft import export
from maxtext_posttrain.peft import lora
from tests import multidevice_losses
from tests import run_utils

LORA = ("lora.enable_lora=true", "lora.lora_rank=8", "lora.lora_alpha=16", "learning_rate=1.e-2")


def _config(tmp, tfds_dir, *overrides, run_name="run"):
  """sft.yml on the first 2,000 training examples (`run_utils.SHORT_TRAIN_SPLIT`): the runs here are at most 60 steps
  of 16."""
  argv = ["", "sft.yml", f"run_name={run_name}", f"base_output_directory={tmp}", f"dataset_path={tfds_dir}"]
  return posttrain_config.initialize(argv + ["eval_interval=0", run_utils.SHORT_TRAIN_SPLIT, *overrides])


def _frozen(model) -> dict:
  return jax.device_get(nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))).to_pure_dict())


def _adapters(model) -> dict:
  return jax.device_get(nnx.state(model, nnx.LoRAParam).to_pure_dict())


def _checkpoint(run_dir) -> str:
  """The latest checkpoint of a run directory, as `load_parameters_path` and `lora.lora_restore_path` take it."""
  steps = [int(p.name) for p in (run_dir / "checkpoints").iterdir()]
  return str(run_dir / "checkpoints" / str(max(steps)) / "items")


def _logits(model, batch):
  return model(batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"], enable_dropout=False)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tfds_dir):
  """One seeded LoRA SFT run of 60 steps, shared by the tests that read it (it ends with an adapter checkpoint)."""
  tmp = tmp_path_factory.mktemp("lora")
  config = _config(tmp, tfds_dir, *LORA, "steps=60", "async_checkpointing=false", f"metrics_file={tmp / 'm.jsonl'}")
  loop = trainer.setup(config)
  before = {"frozen": _frozen(loop.policy()), "adapters": _adapters(loop.policy())}
  trainer.train(loop)
  return {"tmp": tmp, "config": config, "loop": loop, "before": before, "losses": run_utils.losses(tmp / "m.jsonl")}


def test_lora_trains_only_the_adapters(lora_run):
  """Base weights are bit-identical after training, every adapter moved, and optimizer state exists only for them."""
  model = lora_run["loop"].policy()
  jax.tree.map(np.testing.assert_array_equal, _frozen(model), lora_run["before"]["frozen"])
  moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), _adapters(model), lora_run["before"]["adapters"])
  assert jax.tree.leaves(moved) and all(jax.tree.leaves(moved)), moved
  # Adam's moments mirror the adapters exactly (same tree), nothing of the base.
  mu = lora_run["loop"].primary.state.optimizer.opt_state[0].mu.to_pure_dict()
  assert jax.tree.structure(mu) == jax.tree.structure(_adapters(model))


def test_lora_sft_reduces_the_loss(lora_run):
  losses = lora_run["losses"]
  first, last = losses[0], np.mean([losses[s] for s in range(55, 60)])
  assert first > 5.0, first  # ln(512) = 6.2 for a random model
  assert last < 0.6 * first, (first, last)


def test_adapter_checkpoint_holds_only_adapters(lora_run):
  from orbax.checkpoint import v1 as ocp  # pylint: disable=import-outside-toplevel

  latest = _checkpoint(lora_run["tmp"] / "run").removesuffix("/items")
  stored = ocp.metadata(latest).metadata["params"]
  names = {
      "/".join(str(getattr(k, "key", k)) for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(stored)[0]
  }
  assert names and all("_lora_" in n for n in names), sorted(names)[:5]
  # ... and the adapters' Adam moments, which MaxText 0.2.5's own filter drops (see peft/lora.py).
  opt_state = ocp.metadata(latest).metadata["opt_state"]
  moments = [
      "/".join(str(getattr(k, "key", k)) for k in p) for p, _ in jax.tree_util.tree_flatten_with_path(opt_state)[0]
  ]
  assert any("mu" in n and "_lora_a" in n for n in moments), moments[:5]
  assert not any("mu" in n and "_lora_" not in n for n in moments), moments[:5]


def test_merged_export_loads_in_plain_maxtext_with_the_adapter_models_logits(lora_run, tfds_dir):
  """The export, loaded through MaxText's own model creation and `load_parameters_path` (LoRA off), gives the
  logits of the adapter model in memory, within float32 rounding of W + s*A@B vs W x + s*(x A) B (1e-4)."""
  tmp = lora_run["tmp"]
  path = export.export(lora_run["config"], str(tmp / "merged"))
  plain = trainer.setup(
      _config(tmp, tfds_dir, "enable_checkpointing=false", f"load_parameters_path={path}", run_name="plain")
  )
  assert not any(isinstance(v, nnx.LoRAParam) for _, v in nnx.iter_graph(plain.policy()))
  batch = plain.train_batches.load_next_batch()
  expected = _logits(lora_run["loop"].policy(), batch)
  np.testing.assert_allclose(_logits(plain.policy(), batch), expected, rtol=1e-4, atol=1e-4)
  # And the adapters matter: the base alone is far from them.
  assert not np.allclose(
      _logits(plain.policy(), batch),
      _logits(trainer.setup(_config(tmp, tfds_dir, "enable_checkpointing=false", run_name="base")).policy(), batch),
      atol=1e-2,
  )


def test_export_onto_a_base_of_another_shape_is_refused(lora_run, tfds_dir):
  config = _config(lora_run["tmp"], tfds_dir, *LORA, "steps=60", "base_emb_dim=64")
  with pytest.raises(ValueError, match="different model") as error:
    export.export(config, str(lora_run["tmp"] / "never"))
  assert "(128," in str(error.value) and "(64," in str(error.value)
  assert not (lora_run["tmp"] / "never").exists()


def test_adapter_resume_repeats_the_uninterrupted_loss_sequence(tmp_path, tfds_dir):
  """Adapters, their optimizer state and the data order resume, and so does the base loaded from a checkpoint."""
  run_utils.run(_config(tmp_path, tfds_dir, "steps=3", "async_checkpointing=false", run_name="base"))
  base = f"load_parameters_path={tmp_path / 'base' / 'checkpoints' / '2' / 'items'}"
  common = (*LORA, base, "checkpoint_period=2", "async_checkpointing=false", "learning_rate_schedule_steps=6")
  full_loop, _ = run_utils.run(
      _config(tmp_path, tfds_dir, *common, "steps=6", f"metrics_file={tmp_path / 'f.jsonl'}", run_name="f")
  )
  crashed = ("steps=4", "save_checkpoint_on_completion=false", f"metrics_file={tmp_path / 's.jsonl'}")
  run_utils.run(_config(tmp_path, tfds_dir, *common, *crashed, run_name="s"))
  loop, summary = run_utils.run(
      _config(tmp_path, tfds_dir, *common, "steps=6", f"metrics_file={tmp_path / 's.jsonl'}", run_name="s")
  )
  assert summary["start_step"] == 3 and loop.step == 6
  full, split = run_utils.losses(tmp_path / "f.jsonl"), run_utils.losses(tmp_path / "s.jsonl")
  assert sorted(split) == list(range(6))
  np.testing.assert_allclose([split[s] for s in range(6)], [full[s] for s in range(6)], rtol=1e-6)
  # The export of a run started from a loaded base merges onto that base, not onto a fresh one.
  merged = export.export(full_loop.config, str(tmp_path / "merged"))
  plain = trainer.setup(_config(tmp_path, tfds_dir, "enable_checkpointing=false", f"load_parameters_path={merged}"))
  batch = plain.train_batches.load_next_batch()
  np.testing.assert_allclose(_logits(plain.policy(), batch), _logits(full_loop.policy(), batch), rtol=1e-4, atol=1e-4)


def test_lora_restore_path_starts_a_fresh_run_from_stored_adapters_and_a_resume_ignores_it(lora_run, tfds_dir):
  """A fresh run reads the adapters (not the optimizer state) of `lora.lora_restore_path` and so starts at the
  source's trained loss level; once the run directory has a checkpoint, resuming reads that instead (MaxText's
  meaning of the key)."""
  tmp, source = lora_run["tmp"], _adapters(lora_run["loop"].policy())
  metrics = tmp / "restored.jsonl"
  common = (*LORA, f"lora.lora_restore_path={_checkpoint(tmp / 'run')}", "async_checkpointing=false")
  loop = trainer.setup(_config(tmp, tfds_dir, *common, "steps=2", f"metrics_file={metrics}", run_name="restored"))
  assert loop.step == 0
  jax.tree.map(np.testing.assert_array_equal, _adapters(loop.policy()), source)
  mu = jax.tree.leaves(loop.primary.state.optimizer.opt_state[0].mu.to_pure_dict())
  assert mu and not any(np.any(np.asarray(m)) for m in mu)  # a fresh optimizer
  trainer.train(loop)
  assert run_utils.losses(metrics)[0] < 0.6 * lora_run["losses"][0]  # trained level, not a random model's 6.2
  trained = _adapters(loop.policy())
  with pytest.raises(ValueError, match=r"started from lora.lora_restore_path='.*/run/checkpoints/59/items', this"):
    trainer.setup(_config(tmp, tfds_dir, *LORA, "steps=4", run_name="restored"))  # the key dropped on resume
  resumed = trainer.setup(_config(tmp, tfds_dir, *common, "steps=4", run_name="restored"))
  assert resumed.step == 2
  jax.tree.map(np.testing.assert_array_equal, _adapters(resumed.policy()), trained)
  assert not np.array_equal(jax.tree.leaves(trained)[0], jax.tree.leaves(source)[0])


def test_pretrained_model_carries_the_restored_adapters(lora_run, tfds_dir):
  """`lora.pretrained_model`, which the evaluate and sample commands decode, is the adapter run's model under
  `lora.lora_restore_path`: its merged weights are the run's, not the base's."""
  restore = f"lora.lora_restore_path={_checkpoint(lora_run['tmp'] / 'run')}"
  config = _config(lora_run["tmp"], tfds_dir, *LORA, restore, "enable_checkpointing=false", run_name="decode")
  decoded = lora.policy_params(lora.pretrained_model(config, maxtext_utils.get_mesh_from_config(config)), config)
  trained = lora.policy_params(lora_run["loop"].policy(), lora_run["config"])
  jax.tree.map(np.testing.assert_array_equal, decoded.to_pure_dict(), trained.to_pure_dict())


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("lora.lora_rank=4", "lora.lora_alpha=8"), r"other settings: lora_rank=8 there, 4 here; lora_alpha=16.0"),
        (
            ("lora.lora_module_path=decoder/layers/self_attention/(query|key|value|out)",),
            r"trained on a different model .*\n  params/decoder/layers/mlp/wi_0/kernel_lora_a: in the checkpoint",
        ),
    ],
)
def test_lora_restore_path_of_other_adapters_is_refused(lora_run, tfds_dir, overrides, message):
  """Refused before any weights load: the base path given does not exist, so a later check would fail on it."""
  tmp = lora_run["tmp"]
  restore = f"lora.lora_restore_path={_checkpoint(tmp / 'run')}"
  never_read = f"load_parameters_path={tmp / 'no_such_base' / 'items'}"
  config = _config(
      tmp, tfds_dir, *LORA, restore, never_read, "enable_checkpointing=false", *overrides, run_name="refused"
  )
  with pytest.raises(ValueError, match=message):
    trainer.setup(config)


def test_lora_restore_path_of_a_full_checkpoint_is_refused(tmp_path, tfds_dir, sft_checkpoint):
  config = _config(tmp_path, tfds_dir, *LORA, f"lora.lora_restore_path={sft_checkpoint}", "enable_checkpointing=false")
  with pytest.raises(ValueError, match="holds no LoRA adapters; a full checkpoint is read with load_parameters_path"):
    trainer.setup(config)


def test_qlora_nf4_quantizes_the_base_reduces_the_loss_and_exports_the_dequantized_merge(tmp_path, tfds_dir):
  """QLoRA trains adapters over nf4 codes; the export writes dequantized base + adapters as a plain checkpoint whose
  logits, in MaxText without LoRA, are the QLoRA model's (within float32 rounding, 1e-4)."""
  metrics = tmp_path / "m.jsonl"
  config = _config(
      tmp_path,
      tfds_dir,
      *LORA,
      "lora.lora_weight_qtype=nf4",
      "steps=40",
      "async_checkpointing=false",
      f"metrics_file={metrics}",
  )
  loop, _ = run_utils.run(config)
  dtypes = {v.get_value().dtype.name for _, v in nnx.iter_graph(loop.policy()) if isinstance(v, nnx.Param)}
  assert "uint4" in dtypes, dtypes  # nf4 codes of the frozen kernels
  losses = run_utils.losses(metrics)
  assert np.mean([losses[s] for s in range(35, 40)]) < 0.7 * losses[0], losses
  path = export.export(config, str(tmp_path / "merged"))
  plain = trainer.setup(
      _config(tmp_path, tfds_dir, "enable_checkpointing=false", f"load_parameters_path={path}", run_name="plain")
  )
  batch = plain.train_batches.load_next_batch()
  np.testing.assert_allclose(_logits(plain.policy(), batch), _logits(loop.policy(), batch), rtol=1e-4, atol=1e-4)


def test_qlora_int8_quantizes_the_base(tmp_path, tfds_dir):
  config = _config(tmp_path, tfds_dir, *LORA, "lora.lora_weight_qtype=int8", "enable_checkpointing=false")
  loop = trainer.setup(config)
  kernel = loop.policy().decoder.layers.mlp.wi_0.kernel
  assert kernel.array.qvalue.get_value().dtype == np.int8


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("lora.lora_module_path=decoder/layers/nonexistent",), r"matches no module .*decoder/layers/mlp/wi_0"),
        (("lora.lora_rank=0",), r"lora_rank must be > 0"),
        (("lora.lora_rank=200",), r"lora_rank=200 exceeds the width 128 of decoder/layers/"),
        (("lora.lora_restore_path=/nonexistent/3/items",), r"lora_restore_path=/nonexistent/3/items does not exist"),
        (("lora.enable_lora=false", "lora.lora_restore_path=/x"), r"lora_restore_path=/x is set but the policy"),
        (("lora_input_adapters_path=/x",), r"lora_input_adapters_path=/x is MaxText's loader of serving adapters"),
    ],
)
def test_bad_lora_settings_fail_at_setup(tmp_path, tfds_dir, overrides, message):
  config = _config(tmp_path, tfds_dir, *LORA, "enable_checkpointing=false", *overrides)
  with pytest.raises(ValueError, match=message):
    trainer.setup(config)


def test_generation_eval_decodes_the_lora_policy_with_merged_weights(lora_run):
  """MaxText's decode graphs carry no adapters: the merged weights they get decode the adapter model's own greedy
  continuation (float32 weights, so merging rounds nothing that could flip an argmax)."""
  loop = lora_run["loop"]
  loop.objective.evaluate(loop)  # generation eval runs on the LoRA policy
  _, prompt_set = loop.cache["greedy_eval"]
  prompt = list(prompt_set.prompt_ids[0])
  decoded = loop.sampler().generate(lora.policy_params(loop.policy(), loop.config), [prompt], 4, eos_id=-1)[0]
  tokens = list(prompt)
  for _ in range(4):  # the adapter model, recomputed on the growing sequence
    ids = np.asarray([tokens], np.int32)
    logits = loop.policy()(ids, np.arange(len(tokens))[None], np.ones_like(ids), enable_dropout=False)
    tokens.append(int(np.argmax(logits[0, -1])))
  assert decoded == tokens[len(prompt) :]


def test_adapter_gradient_accumulation_matches_one_big_batch(tmp_path, tfds_dir):
  """QLoRA with two microbatches of 8 updates exactly like one batch of 16: only the adapters are differentiated
  (MaxText's accumulation would differentiate the base's nf4 codes too). Plain LoRA takes the same path."""
  common = [*LORA, "learning_rate_schedule_steps=8", "lora.lora_weight_qtype=nf4"]
  big, _ = multidevice_losses.first_losses(tmp_path, tfds_dir, 3, ["per_device_batch_size=16", *common], "big")
  accumulated, _ = multidevice_losses.first_losses(
      tmp_path, tfds_dir, 3, ["per_device_batch_size=8", "gradient_accumulation_steps=2", *common], "accumulated"
  )
  assert big["losses"][2] < big["losses"][0]  # the adapters did move
  np.testing.assert_allclose(accumulated["losses"], big["losses"], rtol=2e-5)


def test_qlora_starts_from_the_quantized_load_parameters_path(tmp_path, tfds_dir, sft_checkpoint):
  """QLoRA over an SFT checkpoint: the frozen base is that checkpoint quantized by qwix (bit for bit what quantizing
  MaxText's loaded model gives), so the first loss is the SFT model's level, not a random model's."""
  metrics = tmp_path / "m.jsonl"
  config = _config(
      tmp_path, tfds_dir, *LORA, "lora.lora_weight_qtype=nf4", f"load_parameters_path={sft_checkpoint}", "steps=2",
      "enable_checkpointing=false", "learning_rate=1e-3", f"metrics_file={metrics}",
  )  # fmt: skip
  loop = trainer.setup(config)
  expected = _frozen(lora.apply(model_creation_utils.from_pretrained(config, loop.mesh), config))
  jax.tree.map(np.testing.assert_array_equal, _frozen(loop.policy()), expected)
  trainer.train(loop)
  assert run_utils.losses(metrics)[0] < 1.0  # a random model starts at ln(512) = 6.2

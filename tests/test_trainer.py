"""The generic loop with the SFT objective on the bundled arithmetic data and a tiny MaxText model."""

import json
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from orbax.checkpoint import v1 as ocp


from maxtext_posttrain import config as posttrain_config
from maxtext_posttrain import objectives
from maxtext_posttrain import trainer
from maxtext_posttrain.data import arithmetic
from tests import multidevice_losses
from tests import paths
from tests import run_utils


def test_sft_learns_arithmetic(sft_run):
  """A seeded run brings the training loss down and greedy held-out answer accuracy up from zero."""
  losses = sft_run["losses"]
  first, last = losses[0], np.mean([losses[s] for s in range(195, 200)])
  assert first > 5.0, first  # ln(512) = 6.2 for a random model
  assert last < 0.05 * first, (first, last)
  before, after = sft_run["summary"]["evals"][0], sft_run["summary"]["evals"][200]
  assert after["eval/answer_accuracy"] >= before["eval/answer_accuracy"] + 0.4, (before, after)
  assert after["eval/loss"] < 0.05 * before["eval/loss"], (before, after)


def test_resume_repeats_the_uninterrupted_loss_sequence(make_config, tmp_path):
  """Resuming restores weights, optimizer state and data order: the losses are those of one uninterrupted run."""
  # One schedule for both (MaxText derives it from `steps` otherwise), so only the interruption differs.
  common = ("checkpoint_period=3", "eval_interval=0", "async_checkpointing=false", "learning_rate_schedule_steps=8")
  run_utils.run(make_config("steps=8", *common, f"metrics_file={tmp_path / 'full.jsonl'}", run_name="full"))
  # A "crash" after 5 steps: no final checkpoint, so the resume starts from step 3's and replays step 4.
  crashed = ("steps=5", "save_checkpoint_on_completion=false")
  run_utils.run(make_config(*crashed, *common, f"metrics_file={tmp_path / 'split.jsonl'}", run_name="split"))
  loop, summary = run_utils.run(
      make_config("steps=8", *common, f"metrics_file={tmp_path / 'split.jsonl'}", run_name="split")
  )
  assert summary["start_step"] == 4 and loop.step == 8
  full, split = run_utils.losses(tmp_path / "full.jsonl"), run_utils.losses(tmp_path / "split.jsonl")
  assert sorted(full) == sorted(split) == list(range(8))
  np.testing.assert_allclose([split[s] for s in range(8)], [full[s] for s in range(8)], rtol=1e-6)
  manifest = json.loads((tmp_path / "split" / "manifest.json").read_text())
  assert [r["start_step"] for r in [manifest["first_run"], *manifest["resumes"]]] == [0, 4]
  assert sorted(int(p.name) for p in (tmp_path / "split" / "checkpoints").iterdir()) == [0, 3, 6, 7]
  # Relaunched once more (a job retried after it finished): nothing to train, no error, nothing written.
  loop, summary = run_utils.run(
      make_config("steps=8", *common, f"metrics_file={tmp_path / 'split.jsonl'}", run_name="split")
  )
  assert summary["start_step"] == summary["end_step"] == 8 and run_utils.losses(tmp_path / "split.jsonl") == split


def test_a_missing_starting_checkpoint_is_named_before_anything_is_built(make_config, tmp_path):
  missing = re.escape(f"No checkpoint at {tmp_path}/nowhere/items (load_parameters_path).")
  with pytest.raises(posttrain_config.ConfigError, match=f"^{missing}$"):
    trainer.setup(make_config(f"load_parameters_path={tmp_path}/nowhere/items"))


def test_checkpoint_of_another_model_shape_is_refused_untouched(make_config, tmp_path):
  run_utils.run(make_config("steps=1", "eval_interval=0", "async_checkpointing=false", run_name="shape"))
  checkpoints = tmp_path / "shape" / "checkpoints"
  before = {p: p.stat().st_mtime_ns for p in checkpoints.rglob("*")}
  config = make_config("steps=2", "base_emb_dim=64", "eval_interval=0", run_name="shape")
  with pytest.raises(ValueError, match="different model") as error:
    trainer.setup(config)
  assert str(checkpoints / "0") in str(error.value) and "(128," in str(error.value) and "(64," in str(error.value)
  assert {p: p.stat().st_mtime_ns for p in checkpoints.rglob("*")} == before


def test_load_parameters_path_starts_from_maxtexts_own_pretraining_checkpoint(make_config, tmp_path):
  """A checkpoint written by MaxText's pre_train.train (same model keys) seeds the policy weights exactly."""
  config = make_config("steps=2", "eval_interval=0", "enable_checkpointing=false")
  model_keys = ["vocab_size", "decoder_block", "base_emb_dim", "base_num_query_heads", "base_num_kv_heads"]
  model_keys += ["head_dim", "base_mlp_dim", "base_num_decoder_layers", "max_target_length", "dtype", "weight_dtype"]
  pretrain = subprocess.run(
      [sys.executable, "-m", "maxtext.trainers.pre_train.train", paths.MAXTEXT_BASE_YML, "run_name=pretrain"]
      + [f"base_output_directory={tmp_path}", "skip_jax_distributed_system=true", "dataset_type=synthetic"]
      + ["attention=dot_product", "per_device_batch_size=2", "steps=1", "async_checkpointing=false"]
      + [f"{k}={getattr(getattr(config, k), 'value', getattr(config, k))}" for k in model_keys],
      capture_output=True,
      text=True,
      timeout=600,
      check=False,
  )
  assert pretrain.returncode == 0, pretrain.stderr[-4000:]
  checkpoint = tmp_path / "pretrain" / "checkpoints" / "0"
  stored = ocp.load_checkpointables(checkpoint)["items"]["params"]["params"]
  loop = trainer.setup(make_config("steps=2", "eval_interval=0", f"load_parameters_path={checkpoint}/items"))
  assert loop.step == 0  # a new run: MaxText's weights, a fresh optimizer
  loaded = loop.primary.state.model.filter(nnx.Param).to_pure_dict()
  assert jax.tree.structure(loaded) == jax.tree.structure(stored)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(loaded), jax.device_get(stored))


def test_completion_only_loss_gives_prompt_tokens_no_weight_and_no_gradient(make_config):
  """Prompt positions carry zero weight: rewriting their targets leaves the loss and every parameter gradient
  unchanged, while rewriting one completion target changes them."""
  config = make_config("eval_interval=0", "packing=false", "enable_checkpointing=false")
  loop = trainer.setup(config)
  batch = jax.tree.map(np.asarray, loop.train_batches.load_next_batch())
  scored = batch["targets_segmentation"] != 0
  first_scored = np.argmax(scored, axis=1)
  assert np.all(first_scored > 3)  # "Question: ..." is never scored
  graphdef, params, rest = nnx.split(loop.policy(), nnx.Param, ...)

  def loss_and_grads(targets):
    def mean_loss(params):
      out = loop.objective.loss(nnx.merge(graphdef, params, rest), {**batch, "targets": targets}, is_train=True)
      return out.total / out.weight

    return jax.value_and_grad(mean_loss)(params)

  rng = np.random.default_rng(0)
  prompt_rewritten = np.where(scored, batch["targets"], rng.integers(4, config.vocab_size, batch["targets"].shape))
  completion_rewritten = batch["targets"].copy()
  completion_rewritten[0, first_scored[0]] = (completion_rewritten[0, first_scored[0]] + 1) % config.vocab_size
  base = loss_and_grads(batch["targets"])
  same = loss_and_grads(prompt_rewritten)
  changed = loss_and_grads(completion_rewritten)
  jax.tree.map(np.testing.assert_array_equal, same, base)
  assert not np.isclose(changed[0], base[0], rtol=1e-7)


@pytest.mark.parametrize("threshold", [1e-3, 0.0])
def test_logged_gradient_norms_are_the_norms_of_the_raw_and_clipped_gradients(make_config, threshold):
  """learning/raw_grad_norm is the gradient's global norm and learning/grad_norm that of the gradient the optimizer
  gets, checked against float64 numpy norms of an independent jax.grad: clipped to the threshold (1e-3 clips a fresh
  model's gradient), or, without clipping (0), the raw norm."""
  config = make_config(
      "eval_interval=0", "packing=false", "enable_checkpointing=false", "enable_dropout=false",
      f"gradient_clipping_threshold={threshold}",
  )  # fmt: skip
  loop = trainer.setup(config)
  batch = loop.train_batches.load_next_batch()
  graphdef, params, rest = nnx.split(loop.policy(), nnx.Param, ...)

  def mean_loss(params):
    out = loop.objective.loss(nnx.merge(graphdef, params, rest), batch, is_train=True)
    return out.total / out.weight

  grads = [np.asarray(g, np.float64) for g in jax.tree.leaves(jax.grad(mean_loss)(params))]
  raw = np.sqrt(sum(np.sum(g * g) for g in grads))
  clipped = [g / raw * threshold for g in grads] if 0 < threshold <= raw else grads
  scalars = loop.primary.train_step(batch, {})["scalar"]
  assert 0 < threshold < raw or threshold == 0, raw
  np.testing.assert_allclose(float(scalars["learning/raw_grad_norm"]), raw, rtol=1e-5)
  np.testing.assert_allclose(
      float(scalars["learning/grad_norm"]), np.sqrt(sum(np.sum(g * g) for g in clipped)), rtol=1e-5
  )


def test_remat_policy_none_keeps_its_meaning(make_config):
  """`remat_policy=none` with unscanned layers: the train step's backward pass reuses the forward's activations, so it
  costs about a quarter fewer FLOPs than under remat_policy=full. (MaxText's config reader turns "none" into None,
  which its unscanned decoder takes for full remat: the two steps were the same program.)"""
  flops = {}
  for policy in ("none", "full"):
    loop = trainer.setup(make_config("scan_layers=false", f"remat_policy={policy}", "enable_checkpointing=false"))
    with loop.primary.scope():
      compiled = loop.primary.p_train_step.lower(loop.primary.state, loop.train_batches.load_next_batch(), {}).compile()
    flops[policy] = compiled.cost_analysis()["flops"]
  assert flops["none"] < 0.85 * flops["full"], flops


def test_packed_and_padded_batches_give_the_same_loss(make_config, tmp_path):
  """Packing changes batch layout only: summed loss and weight over the same examples are unchanged."""
  rows = arithmetic.generate("easy", "test", 40, seed=3)
  path = tmp_path / "examples.jsonl"
  path.write_text("".join(json.dumps(row) + "\n" for row in rows))
  files = ("grain_file_type=jsonl", f"grain_train_files={path}", f"grain_eval_files={path}", "eval_interval=1")
  packed = trainer.setup(make_config(*files, "packing=true", run_name="packed"))
  padded_config = make_config(*files, "packing=false", run_name="padded")
  padded_data = objectives.get("sft")(padded_config).make_data(packed.mesh)
  model = packed.policy()

  def summed(batches):
    outs = [packed.objective.loss(model, batch, is_train=False) for batch in batches]
    return sum(float(o.total) for o in outs), sum(float(o.weight) for o in outs), len(outs)

  packed_total, packed_weight, packed_batches = summed(packed.data.eval)
  padded_total, padded_weight, padded_batches = summed(padded_data.eval)
  assert packed_batches < padded_batches  # packing did put several examples in a row
  assert packed_weight == padded_weight > 0
  np.testing.assert_allclose(packed_total / packed_weight, padded_total / padded_weight, rtol=1e-5)


def test_gradient_accumulation_matches_one_big_batch(tmp_path, tfds_dir):
  """Two microbatches of 8 update exactly like one batch of 16: both normalise by the tokens of all 16 rows."""
  common = ["learning_rate_schedule_steps=8"]
  big, _ = multidevice_losses.first_losses(tmp_path, tfds_dir, 3, ["per_device_batch_size=16", *common], "big")
  accumulated, _ = multidevice_losses.first_losses(
      tmp_path, tfds_dir, 3, ["per_device_batch_size=8", "gradient_accumulation_steps=2", *common], "accumulated"
  )
  np.testing.assert_allclose(accumulated["losses"], big["losses"], rtol=2e-5)


def test_a_batch_without_the_declared_keys_fails_the_first_step(make_config):
  loop = trainer.setup(make_config("steps=1", "eval_interval=0", "enable_checkpointing=false"))
  loop.objective.batch_keys = (*loop.objective.batch_keys, "chosen")
  with pytest.raises(ValueError, match=r"posttrain_mode=sft: batches lack \['chosen'\]"):
    trainer.train(loop)
  assert loop.step == 0


def test_training_features_the_step_lacks_fail_at_start(make_config):
  config = make_config(
      "mtp_num_layers=1",
      "parameter_memory_host_offload=true",
      "enable_continuous_checkpointing=true",
  )
  with pytest.raises(
      ValueError,
      match=r"does not support yet: multi-token prediction .*; parameter_memory_host_offload; "
      r"enable_continuous_checkpointing\.",
  ):
    trainer.setup(config)


def test_training_stops_at_target_eval_loss(make_config):
  config = make_config(
      "steps=60", "eval_interval=10", "target_eval_loss=1.0", "enable_checkpointing=false", run_utils.WHOLE_TRAIN_SPLIT
  )
  _, summary = run_utils.run(config)
  assert summary["end_step"] < 60
  assert summary["evals"][summary["end_step"]]["eval/loss"] <= 1.0
  assert all(e["eval/loss"] > 1.0 for step, e in summary["evals"].items() if step < summary["end_step"])


_TEACHER = ("teacher_overrides.load_parameters_path=/teacher", "distill_beta=1.0", "distill_layer_indices=[1]")


@pytest.mark.parametrize(
    "config_file, mode, scalars, figures, keys",
    [
        ("sft.yml", "sft", {"learning/z_loss": 0.0}, {"perplexity": float(np.exp(0.5))}, ()),
        (
            "dpo.yml",
            "dpo",
            {"learning/rewards/accuracy": 0.75, "learning/rewards/margin": 0.25},
            {"reward_accuracy": 0.75, "reward_margin": 0.25},
            (),
        ),
        ("grpo.yml", "grpo", {"rl/reward_mean": 0.6, "learning/kl": 0.01}, {"reward": 0.6, "kl": 0.01}, ()),
        (
            "grpo.yml",
            "grpo",
            {"rl/reward_mean": 0.6, "learning/kl": 0.01, "learning/teacher_kl": 0.2},
            {"reward": 0.6, "kl": 0.01, "teacher_kl": 0.2},
            ("rl.teacher_kl_coef=0.5", *_TEACHER[:1]),
        ),
        (
            "distill.yml",
            "distill",
            {
                "learning/ce": 1.0,
                "learning/divergence": 0.1,
                "learning/top1_agreement": 0.8,
                "learning/feature_loss": 0.3,
            },
            {"ce": 1.0, "divergence": 0.1, "agreement": 0.8, "feature_loss": 0.3},
            _TEACHER,
        ),
    ],
    ids=["sft", "dpo", "grpo", "grpo_teacher", "distill_layers"],
)
def test_the_step_line_shows_each_objectives_own_figures(
    make_config, monkeypatch, config_file, mode, scalars, figures, keys
):
  """MaxText's per-step line reads `lm_loss: 0.000, perplexity: 0.000` for losses that are no language-model cross
  entropy; ours follows the loss with the objective's figures (SFT's perplexity is exp of its loss), including the
  loss terms a run switches on (the KL to a teacher, layer transfer's feature loss)."""
  config = make_config("rl.grpo_beta=0.04", "enable_tensorboard=false", *keys, config_file=config_file)
  objective = objectives.get(mode)(config)
  logger = trainer.MetricLogger(config, lambda step: 1e-3, objective)
  lines = []
  monkeypatch.setattr(trainer.max_logging, "log", lines.append)
  perf = {"perf/step_time_seconds": 0.5, "perf/per_device_tflops_per_sec": 1.0, "perf/per_device_tokens_per_sec": 9.0}
  scalars = scalars | perf | {"learning/loss": 0.5, "learning/total_weights": 64.0}
  logger._log_training_metrics({"scalar": scalars}, 7)  # pylint: disable=protected-access
  expected = ", ".join(f"{name}: {value:.3f}" for name, value in ({"loss": 0.5} | figures).items())
  assert lines == [
      f"completed step: 7, seconds: 0.500, TFLOP/s/device: 1.000, Tokens/s/device: 9.000, total_weights: 64.0, {expected}"
  ]

"""The generic loop with the SFT objective on the bundled arithmetic data and a tiny MaxText model."""

import json
import os

import jax
import numpy as np
import pytest

from maxtext_posttrain import objectives
from maxtext_posttrain.data import arithmetic
from tests import multidevice_losses
from maxtext_posttrain import trainer


def _losses(metrics_file) -> dict[int, float]:
  losses = {}
  with open(metrics_file, encoding="utf-8") as f:
    for line in f:
      row = json.loads(line)
      if "learning/loss" in row:
        losses[int(row["step"])] = row["learning/loss"]
  return losses


def _run(config):
  loop = trainer.setup(config)
  return loop, trainer.train(loop)


def test_sft_learns_arithmetic(make_config, tmp_path):
  """A seeded run brings the training loss down and greedy held-out answer accuracy up from zero."""
  metrics = tmp_path / "metrics.jsonl"
  config = make_config(
      "steps=200",
      "eval_interval=200",
      "eval_generation_examples=64",
      "enable_checkpointing=false",
      f"metrics_file={metrics}",
  )
  _, summary = _run(config)
  losses = _losses(metrics)
  first, last = losses[0], np.mean([losses[s] for s in range(195, 200)])
  assert first > 5.0, first  # ln(512) = 6.2 for a random model
  assert last < 0.05 * first, (first, last)
  before, after = summary["evals"][0], summary["evals"][200]
  assert before["eval/answer_accuracy"] == 0.0
  assert after["eval/answer_accuracy"] >= 0.4, after
  assert after["eval/loss"] < 0.05 * before["eval/loss"], (before, after)


def test_resume_repeats_the_uninterrupted_loss_sequence(make_config, tmp_path):
  """Stopping after 4 steps and resuming restores weights, optimizer and data order: same losses as one run."""
  # One schedule for both (MaxText derives it from `steps` otherwise), so only the interruption differs.
  common = ("checkpoint_period=3", "eval_interval=0", "async_checkpointing=false", "learning_rate_schedule_steps=8")
  _run(make_config("steps=8", *common, f"metrics_file={tmp_path / 'full.jsonl'}", run_name="full"))
  _run(make_config("steps=4", *common, f"metrics_file={tmp_path / 'split.jsonl'}", run_name="split"))
  loop, summary = _run(make_config("steps=8", *common, f"metrics_file={tmp_path / 'split.jsonl'}", run_name="split"))
  assert summary["start_step"] == 4 and loop.step == 8
  full, split = _losses(tmp_path / "full.jsonl"), _losses(tmp_path / "split.jsonl")
  assert sorted(full) == sorted(split) == list(range(8))
  np.testing.assert_allclose([split[s] for s in range(8)], [full[s] for s in range(8)], rtol=1e-6)
  manifest = json.loads((tmp_path / "split" / "manifest.json").read_text())
  assert [r["start_step"] for r in [manifest["first_run"], *manifest["resumes"]]] == [0, 4]


def test_checkpoint_of_another_model_shape_is_refused_untouched(make_config, tmp_path):
  _run(make_config("steps=1", "eval_interval=0", "async_checkpointing=false", run_name="shape"))
  checkpoints = tmp_path / "shape" / "checkpoints"
  before = {p: p.stat().st_mtime_ns for p in checkpoints.rglob("*")}
  config = make_config("steps=2", "base_emb_dim=64", "eval_interval=0", run_name="shape")
  with pytest.raises(ValueError, match="different model") as error:
    trainer.setup(config)
  assert str(checkpoints / "0") in str(error.value) and "(128," in str(error.value) and "(64," in str(error.value)
  assert {p: p.stat().st_mtime_ns for p in checkpoints.rglob("*")} == before


def test_load_parameters_path_starts_from_a_maxtext_checkpoint(make_config):
  """A run started with `load_parameters_path` (MaxText's `<ckpt>/<step>/items`) evaluates like the source model."""
  common = ("eval_interval=20", "eval_generation_examples=0", "async_checkpointing=false")
  source, summary = _run(make_config("steps=20", *common, run_name="source"))
  items = os.path.join(source.config.checkpoint_dir, "19", "items")
  target = trainer.setup(make_config("steps=5", *common, f"load_parameters_path={items}", run_name="target"))
  assert target.step == 0  # a new run: the checkpoint's weights, a fresh optimizer
  np.testing.assert_allclose(trainer.evaluate(target)["eval/loss"], summary["evals"][20]["eval/loss"], rtol=1e-5)


def test_completion_only_loss_ignores_prompt_tokens(make_config):
  """Prompt positions carry zero weight, so the loss gradient w.r.t. their logits is exactly zero."""
  config = make_config("eval_interval=0", "packing=false")
  objective = objectives.get("sft")(config)
  data = objective.make_data(trainer.maxtext_utils.get_mesh_from_config(config))
  batch = jax.tree.map(np.asarray, next(data.train))
  rng = np.random.default_rng(0)
  logits = rng.normal(size=batch["targets"].shape + (config.vocab_size,)).astype(np.float32)

  def loss_of(logits):
    out = objective.loss(lambda **_: logits, batch, is_train=True)
    return out.total / out.weight

  grad = np.asarray(jax.grad(loss_of)(logits))
  weights = batch["targets_segmentation"] != 0
  completion_start = np.argmax(weights, axis=1)  # first scored position of each (unpacked) row
  for row, start in enumerate(completion_start):
    assert start > 3  # "Question: ..." is never scored
    assert np.all(grad[row, :start] == 0)
  assert np.all(np.abs(grad[weights]).sum(-1) > 0)


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

"""Feature (distill_beta) and attention (distill.attention_weight) transfer between matched layers of the 2-layer
student and the session's 4-layer teacher: the loss against numpy on the captured layers, learning, bad input."""

import numpy as np
import pytest
from flax import nnx

from maxtext_posttrain import config as posttrain_config
from maxtext_posttrain import layer_capture
from maxtext_posttrain import layer_transfer
from maxtext_posttrain import roles
from maxtext_posttrain import trainer
from maxtext_posttrain.peft import lora
from tests import run_utils

BETA, ATTENTION_WEIGHT = 2.0, 0.25
LAYERS = ("distill_layer_indices=[0,1]", "distill.teacher_layer_indices=[1,3]")


def _overrides(teacher, *extra):
  return (
      f"teacher_overrides.load_parameters_path={teacher}", "enable_checkpointing=false", "per_device_batch_size=4",
      f"distill_beta={BETA}", f"distill.attention_weight={ATTENTION_WEIGHT}", *LAYERS, *extra,
  )  # fmt: skip


@pytest.fixture(scope="module")
def transfer_run(tmp_path_factory, tfds_dir, sft_checkpoint, deep_sft_checkpoint):
  """The SFT student distilled with both terms for 30 steps (loop, metric rows)."""
  out = tmp_path_factory.mktemp("layers")
  argv = ["", "distill.yml", "run_name=layers", f"base_output_directory={out}", f"dataset_path={tfds_dir}"]
  argv += [f"load_parameters_path={sft_checkpoint}", "steps=30", "eval_interval=0", f"metrics_file={out}/m.jsonl"]
  argv += ["learning_rate=1e-3", *_overrides(deep_sft_checkpoint)]
  loop = trainer.setup(posttrain_config.initialize(argv))
  batch = loop.objective.before_step(loop, loop.train_batches.load_next_batch())
  teacher = loop.role(roles.TEACHER)
  models = (loop.policy(), nnx.merge(teacher.graphdef, teacher.state))
  before = loop.objective.loss(*models[:1], batch, False, {roles.TEACHER: models[1]})
  captured = [layer_capture.forward_with_captures(m, batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
              for m in models]  # fmt: skip
  trainer.train(loop)
  return {"loss": before, "batch": batch, "captured": captured, "rows": run_utils.rows(out / "m.jsonl")}


def _cosine_distance(a, b):
  norms = np.maximum(np.sum(a * a, -1), 1e-6) ** 0.5 * np.maximum(np.sum(b * b, -1), 1e-6) ** 0.5
  return 1 - np.sum(a * b, -1) / norms


def test_the_layer_terms_match_numpy_on_the_captured_layers(transfer_run):
  """feature: the mean over matched layers (student 0, 1 -> teacher 1, 3) and completion tokens of the cosine
  distance of MaxText's out-projection activations; attention: the same mean of KL(teacher || student) per query over
  the keys, averaged over heads; the loss adds beta x feature + weight x attention to the logit loss."""
  out, batch = transfer_run["loss"], transfer_run["batch"]
  (_, student), (_, teacher) = transfer_run["captured"]
  mask = np.asarray(batch["targets_segmentation"]) != 0
  pairs = ((0, 1), (1, 3))
  s_features, t_features = (np.asarray(c.features, np.float64) for c in (student, teacher))
  feature = np.mean([_cosine_distance(s_features[i], t_features[j])[mask].mean() for i, j in pairs])
  s_att, t_att = (np.maximum(np.asarray(c.attention, np.float64), np.finfo(np.float32).tiny) for c in (student, teacher))
  kl = [np.sum(t_att[j] * (np.log(t_att[j]) - np.log(s_att[i])), -1).mean(1)[mask].mean() for i, j in pairs]
  weight = float(out.weight)
  np.testing.assert_allclose(float(out.metrics["feature_loss"]) / weight, feature, rtol=1e-4)
  np.testing.assert_allclose(float(out.metrics["attention_loss"]) / weight, np.mean(kl), rtol=1e-4)
  alpha = float(out.metrics["distill_alpha"]) / weight
  logit = (
      alpha * float(out.metrics["soft_loss"]) + (1 - alpha) * float(out.metrics["ce"] + out.metrics["z_loss"])
  ) / weight
  np.testing.assert_allclose(
      float(out.total) / weight, logit + BETA * feature + ATTENTION_WEIGHT * np.mean(kl), rtol=1e-4
  )


def test_training_lowers_the_feature_and_attention_losses(transfer_run):
  rows = transfer_run["rows"]
  print(f"feature loss {rows[0]['learning/feature_loss']:.4f} -> {rows[29]['learning/feature_loss']:.4f}, "
        f"attention loss {rows[0]['learning/attention_loss']:.4f} -> {rows[29]['learning/attention_loss']:.4f}")  # fmt: skip
  for key, factor in (("learning/feature_loss", 0.85), ("learning/attention_loss", 0.5)):
    assert rows[29][key] < factor * rows[0][key], (key, rows[0][key], rows[29][key])


def test_bad_layer_settings_fail_at_start_naming_them(make_config, deep_sft_checkpoint, tmp_path):
  def setup(*extra):
    return trainer.setup(make_config(*_overrides(deep_sft_checkpoint), *extra, config_file="distill.yml"))

  with pytest.raises(ValueError, match=r"distill.teacher_layer_indices=\[1, 4\]: the teacher has 4 decoder layers; "
                     r"valid layer indices are 0..3"):  # fmt: skip
    setup("distill.teacher_layer_indices=[1,4]")
  with pytest.raises(ValueError, match=r"distill_layer_indices=\[0, 2\]: the student has 2 decoder layers; valid"):
    setup("distill_layer_indices=[0,2]", "distill.teacher_layer_indices=[0,1]")
  with pytest.raises(ValueError, match=r"distill_layer_indices is unset, which matches every layer, but the student "
                     r"has 2 decoder layers and the teacher 4"):  # fmt: skip
    setup("distill_layer_indices=null", "distill.teacher_layer_indices=null")
  with pytest.raises(ValueError, match=r"compares emb_dim 96 \(student\) with 128 \(teacher\): "
                     r"distill.feature_projection=pool needs one width to divide the other"):  # fmt: skip
    setup("base_emb_dim=96", "distill.feature_projection=pool")
  with pytest.raises(ValueError, match=r"need the teacher's layers, which posttrain_mode=distill with offline_data_dir"):
    setup(f"offline_data_dir={tmp_path}", "distill.top_k=8")
  with pytest.raises(ValueError, match=r"need the teacher's layers, which posttrain_mode=distill_on_policy"):
    trainer.setup(make_config(*_overrides(deep_sft_checkpoint), config_file="distill_on_policy.yml"))


def test_a_narrower_student_learns_a_feature_map_that_decoding_leaves_out(make_config, deep_sft_checkpoint):
  """A 64-wide student against the 128-wide teacher, on hidden states (distill.feature_source=hidden): its layers'
  outputs meet the teacher's through its own [64, 128] `distill_projection` (numpy), which the optimizer moves, while
  the weights decoding reads are MaxText's model's alone."""
  config = make_config(*_overrides(deep_sft_checkpoint, "base_emb_dim=64", "head_dim=16", "distill.attention_weight=0",
                                   "distill.feature_source=hidden", "steps=3", "eval_interval=0"),
                       config_file="distill.yml")  # fmt: skip
  loop = trainer.setup(config)
  student = loop.policy()
  kernel = np.asarray(getattr(student, layer_transfer.PROJECTION).get_value(), np.float64)
  assert kernel.shape == (64, 128)
  assert layer_transfer.PROJECTION not in lora.policy_params(student, config)
  batch = loop.objective.before_step(loop, loop.train_batches.load_next_batch())
  teacher = loop.role(roles.TEACHER)
  teacher = nnx.merge(teacher.graphdef, teacher.state)
  out = loop.objective.loss(student, batch, False, {roles.TEACHER: teacher})
  inputs = (batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
  (_, s), (_, t) = (layer_capture.forward_with_captures(m, *inputs) for m in (student, teacher))
  mask = np.asarray(batch["targets_segmentation"]) != 0
  s_features, t_features = np.asarray(s.hidden, np.float64) @ kernel, np.asarray(t.hidden, np.float64)
  feature = np.mean([_cosine_distance(s_features[i], t_features[j])[mask].mean() for i, j in ((0, 1), (1, 3))])
  np.testing.assert_allclose(float(out.metrics["feature_loss"] / out.weight), feature, rtol=1e-4)
  trainer.train(loop)
  moved = np.asarray(getattr(loop.policy(), layer_transfer.PROJECTION).get_value(), np.float64)
  assert np.abs(moved - kernel).max() > 1e-4

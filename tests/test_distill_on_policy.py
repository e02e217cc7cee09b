"""On-policy distillation (posttrain_mode=distill_on_policy): the session's 2-layer SFT student samples, its 4-layer
SFT teacher grades every sampled token."""

import numpy as np
import pytest
from flax import nnx

from maxtext_posttrain import config as posttrain_config
from maxtext_posttrain import forward
from maxtext_posttrain import roles
from maxtext_posttrain import trainer
from tests import run_utils

LEARNING_STEPS = 100


def _loop(make_config, sft_checkpoint, deep_sft_checkpoint, *overrides):
  teacher = f"teacher_overrides.load_parameters_path={deep_sft_checkpoint}"
  return trainer.setup(
      make_config(f"load_parameters_path={sft_checkpoint}", teacher, "enable_checkpointing=false",
                  "per_device_batch_size=4", *overrides, config_file="distill_on_policy.yml")
  )  # fmt: skip


def _numpy_log_softmax(logits):
  logits = np.asarray(logits, np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def on_policy_run(tmp_path_factory, tfds_dir, sft_checkpoint, deep_sft_checkpoint):
  """distill_on_policy.yml's recipe from the session's 2-layer SFT student, its teacher the 4-layer SFT model."""
  out = tmp_path_factory.mktemp("distill_on_policy")
  argv = ["", "distill_on_policy.yml", "run_name=gkd", f"base_output_directory={out}", f"dataset_path={tfds_dir}"]
  argv += [f"load_parameters_path={sft_checkpoint}", f"teacher_overrides.load_parameters_path={deep_sft_checkpoint}"]
  argv += [f"steps={LEARNING_STEPS}", "eval_interval=0"]
  argv += ["enable_checkpointing=false", f"metrics_file={out / 'metrics.jsonl'}"]
  run_utils.run(posttrain_config.initialize(argv))
  return run_utils.rows(out / "metrics.jsonl")


def test_on_policy_distillation_lowers_the_reverse_kl_on_the_students_own_samples(on_policy_run):
  rows = on_policy_run
  first = np.mean([rows[step]["learning/divergence"] for step in range(10)])
  last = np.mean([rows[step]["learning/divergence"] for step in range(LEARNING_STEPS - 10, LEARNING_STEPS)])
  rewards = [
      np.mean([rows[step]["rl/reward_mean"] for step in steps])
      for steps in (range(10), range(LEARNING_STEPS - 10, LEARNING_STEPS))
  ]
  print(f"reverse KL on the student's samples: first 10 steps {first:.4f}, last 10 steps {last:.4f}; their mean "
        f"reward {rewards[0]:.3f} -> {rewards[1]:.3f}")  # fmt: skip
  assert all(rows[step]["distill/on_policy"] == 1.0 for step in range(LEARNING_STEPS))
  assert last < 0.6 * first, (first, last)


TEMPERATURE, BETA = 2.0, 0.3


@pytest.fixture(scope="module")
def half_on_policy(tmp_path_factory, tfds_dir, sft_checkpoint, deep_sft_checkpoint):
  """A loop of GKD's lambda 0.5 with the JSD at BETA and T = TEMPERATURE, built once for the tests that take steps by
  hand."""
  argv = ["", "distill_on_policy.yml", "run_name=half", f"base_output_directory={tmp_path_factory.mktemp('half')}"]
  argv += [f"dataset_path={tfds_dir}", f"load_parameters_path={sft_checkpoint}", "enable_checkpointing=false"]
  argv += [f"teacher_overrides.load_parameters_path={deep_sft_checkpoint}", "per_device_batch_size=4"]
  argv += ["distill.on_policy_fraction=0.5", "distill.divergence=jsd", f"distill.jsd_beta={BETA}"]
  argv += [f"distill_temperature={TEMPERATURE}"]
  return trainer.setup(posttrain_config.initialize(argv))


def test_the_loss_is_the_divergence_on_the_students_samples(half_on_policy):
  """T^2 JSD_beta(teacher_T || student_T) on the sampled completion tokens only, against numpy float64 on the two
  models' logits; the rows hold each prompt (as the sampler saw it) followed by the completion it sampled."""
  temperature, beta, loop = TEMPERATURE, BETA, half_on_policy
  objective = loop.objective
  loop.step = [objective.on_policy(step) for step in range(10)].index(True)
  prompts = loop.train_batches.load_next_batch()
  batch = objective.before_step(loop, prompts)
  teacher = loop.role(roles.TEACHER)
  student, teacher = loop.policy(), nnx.merge(teacher.graphdef, teacher.state)
  out = objective.loss(student, batch, False, {roles.TEACHER: teacher})

  inputs = (batch["inputs"], batch["positions"], batch["segmentation"])
  log_q, log_p = (_numpy_log_softmax(np.asarray(forward.logits(m, *inputs)) / temperature) for m in (student, teacher))
  q, p = np.exp(log_q), np.exp(log_p)
  log_m = np.log(beta * p + (1 - beta) * q)
  per_token = beta * (p * (log_p - log_m)).sum(-1) + (1 - beta) * (q * (log_q - log_m)).sum(-1)
  mask = np.asarray(batch["completion_mask"]) != 0
  np.testing.assert_allclose(float(out.total / out.weight), temperature**2 * per_token[mask].mean(), rtol=1e-4)
  assert float(out.weight) == mask.sum()

  inputs, targets = np.asarray(batch["inputs"]), np.asarray(batch["targets"])
  assert objective.step_metrics["distill/on_policy"] == 1.0
  for row, index in enumerate(objective.indices(prompts)):
    prompt = list(objective.train_prompts.prompt_ids[index])
    np.testing.assert_array_equal(inputs[row, : len(prompt)], prompt)
    assert mask[row, : len(prompt) - 1].sum() == 0 and mask[row].sum() > 0
    assert targets[row, len(prompt) - 1] == inputs[row, len(prompt)]  # the first sampled token


def test_off_policy_steps_train_on_the_reference_completions(half_on_policy):
  """distill.on_policy_fraction is GKD's lambda: a seeded draw per step decides; the other steps' rows are the
  prompts followed by their answer column, nothing sampled."""
  loop = half_on_policy
  objective = loop.objective
  draws = [objective.on_policy(step) for step in range(200)]
  assert draws == [objective.on_policy(step) for step in range(200)]  # fixed by the seed and the step
  assert 70 < sum(draws) < 130
  loop.step = draws.index(False)
  prompts = loop.train_batches.load_next_batch()
  batch = objective.before_step(loop, prompts)
  assert objective.step_metrics["distill/on_policy"] == 0.0 and "rl/rollout_seconds" not in objective.step_metrics
  targets, mask = np.asarray(batch["targets"]), np.asarray(batch["completion_mask"]) != 0
  for row, index in enumerate(objective.indices(prompts)):
    expected = objective.encoder.completion_ids(objective.train_prompts.answers[index])
    np.testing.assert_array_equal(targets[row][mask[row]], expected)


def test_bad_on_policy_settings_fail_at_start_naming_them(make_config, sft_checkpoint, deep_sft_checkpoint):
  with pytest.raises(ValueError, match=r"distill_alpha=0.5: posttrain_mode=distill_on_policy trains on the teacher"):
    _loop(make_config, sft_checkpoint, deep_sft_checkpoint, "distill_alpha=0.5")
  with pytest.raises(ValueError, match=r"does not use rl.num_iterations, rl.grpo_beta"):
    _loop(make_config, sft_checkpoint, deep_sft_checkpoint, "rl.num_iterations=2", "rl.grpo_beta=0.1")
  with pytest.raises(ValueError, match=r"Role teacher: the checkpoint at .* does not hold the weights"):
    _loop(make_config, sft_checkpoint, sft_checkpoint)  # a 2-layer checkpoint for the 4-layer teacher
  with pytest.raises(ValueError, match=r"distill.on_policy_fraction=0.5: posttrain_mode=distill trains on the dataset"):
    trainer.setup(
        make_config(f"teacher_overrides.load_parameters_path={deep_sft_checkpoint}", "distill.on_policy_fraction=0.5",
                    config_file="distill.yml")
    )  # fmt: skip

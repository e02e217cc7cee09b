"""RL with a teacher (rl.teacher_kl_coef): the GRPO family and PPO add a per-token KL(policy || teacher) to the
policy loss, the teacher being distillation's (the yml plus teacher_overrides, read inside the jitted step)."""

import numpy as np
import pytest
from flax import nnx

from maxtext_posttrain import config as config_lib
from maxtext_posttrain import roles
from maxtext_posttrain import trainer
from maxtext_posttrain.objectives import rl_base
from tests import run_utils

SMALL = ("per_device_batch_size=4", "rl.num_generations=4", "enable_checkpointing=false", "eval_interval=0")


def _config(make_config, sft_checkpoint, deep_sft_checkpoint, *overrides, config_file="grpo.yml"):
  teacher = (
      f"teacher_overrides.load_parameters_path={deep_sft_checkpoint}",
      f"teacher_overrides.base_num_decoder_layers={run_utils.DEEP_SFT_LAYERS}",
  )
  start = f"load_parameters_path={sft_checkpoint}"
  return make_config(start, *teacher, *SMALL, *overrides, config_file=config_file)


def _numpy_log_softmax(logits):
  logits = np.asarray(logits, np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


@pytest.mark.parametrize("config_file", ["grpo.yml", "ppo.yml"])
def test_the_teacher_term_adds_its_coefficient_times_the_reverse_kl(
    make_config, sft_checkpoint, deep_sft_checkpoint, config_file
):
  """loss(coef) - loss(0) = coef x the policy loss's aggregation of KL(policy_T || teacher_T) per completion token,
  against numpy float64 on the two models' logits; the term's metric is that KL's mean."""
  coef = 0.5
  config = _config(
      make_config, sft_checkpoint, deep_sft_checkpoint, f"rl.teacher_kl_coef={coef}", "decode_sampling_temperature=0.7",
      config_file=config_file,
  )  # fmt: skip
  loop = trainer.setup(config)
  objective = loop.objective
  batch = objective.before_step(loop, loop.train_batches.load_next_batch())
  teacher = loop.role(roles.TEACHER)
  student, teacher = loop.policy(), nnx.merge(teacher.graphdef, teacher.state)
  out = objective.loss(student, batch, False, {roles.TEACHER: teacher})
  without = config_lib.with_overrides(config, rl=config.rl.model_copy(update={"teacher_kl_coef": 0.0}))
  plain = type(objective)(without).loss(student, batch, False, None)

  log_q, log_p = (_numpy_log_softmax(rl_base.token_logps(m, batch, 0.7)[1]) for m in (student, teacher))
  kl = (np.exp(log_q) * (log_q - log_p)).sum(-1)
  mask = np.asarray(batch["completion_mask"]) != 0
  per_sequence = [kl[i][mask[i]].mean() for i in range(len(kl)) if mask[i].any()]
  assert objective.agg_mode == "seq-mean-token-mean"
  np.testing.assert_allclose(float(out.total - plain.total), coef * np.sum(per_sequence), rtol=1e-4)
  np.testing.assert_allclose(float(out.metrics["teacher_kl"] / out.weight), np.mean(per_sequence), rtol=1e-4)
  assert np.mean(per_sequence) > 0.01 and "teacher_kl" not in plain.metrics


def test_the_teacher_term_needs_a_teacher(make_config):
  with pytest.raises(ValueError, match=r"rl.teacher_kl_coef=0.1 needs the teacher's weights: set "):
    trainer.setup(make_config("rl.teacher_kl_coef=0.1", *SMALL, config_file="grpo.yml"))

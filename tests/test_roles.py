"""The roles contract: role configs with MaxText-style overrides, frozen roles read inside the jitted step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtext_posttrain import forward
from maxtext_posttrain import roles
from maxtext_posttrain import trainer
from maxtext_posttrain.objectives import base as objectives_base
from maxtext_posttrain.objectives import ppo
from maxtext_posttrain.objectives import rl_base
from maxtext_posttrain.objectives import sft
from tests import run_utils

PPO = "ppo.yml"


@objectives_base.register
class _SftWithReferenceInStep(sft.SFT):
  """SFT whose loss reads the frozen reference inside the jitted step and reports how far the policy's logits are
  from it: 0 while the policy is its starting point, more once it has trained."""

  name = "test_sft_reference_in_step"

  def __init__(self, config):
    super().__init__(config)
    self.roles += (roles.reference(in_step=True),)

  def loss(self, model, batch, is_train, frozen=None):
    out = super().loss(model, batch, is_train)
    args = (batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
    gap = jnp.abs(forward.logits(model, *args) - forward.logits(frozen["reference"], *args)).max()
    return objectives_base.LossOutput(out.total, out.weight, out.metrics | {"reference_gap": gap * out.weight})


def test_a_frozen_role_is_read_inside_the_jitted_step(make_config, tmp_path):
  """The reference's weights are an argument of the train and eval steps (not donated: every step reads them
  again): the gap is 0 at the first step and after training it is not, while the reference itself never moves."""
  metrics_file = tmp_path / "metrics.jsonl"
  config = make_config(
      "posttrain_mode=test_sft_reference_in_step", "per_device_batch_size=2", "steps=3", "eval_interval=3",
      "eval_steps=1", "eval_generation_examples=0", f"metrics_file={metrics_file}", "enable_checkpointing=false",
  )  # fmt: skip
  loop, summary = run_utils.run(config)
  rows = run_utils.rows(metrics_file)
  gaps = [rows[step]["learning/reference_gap"] for step in range(3)]
  assert gaps[0] == 0.0 < gaps[1] < gaps[2], gaps
  assert summary["evals"][3]["eval/reference_gap"] > 0
  start = trainer.setup(config)
  jax.tree.map(
      np.testing.assert_array_equal,
      jax.device_get(loop.frozen["reference"].state.filter(nnx.Param).to_pure_dict()),
      jax.device_get(start.frozen["reference"].state.filter(nnx.Param).to_pure_dict()),
  )


def test_role_overrides_build_another_maxtext_config(make_config):
  """`critic_overrides` are MaxText keys applied as MaxText applies its own (derived keys follow): a critic one
  layer deep and half as wide, checkpointing beside the policy."""
  config = make_config("critic_overrides.base_num_decoder_layers=1", "critic_overrides.base_emb_dim=64", config_file=PPO)
  spec = roles.RoleSpec("critic", trained=True, head="scalar", overrides_key="critic_overrides",
                        overrides=dict(config.critic_overrides))  # fmt: skip
  role = roles.role_config(config, spec, primary=False)
  assert (role.num_decoder_layers, role.emb_dim, config.num_decoder_layers, config.emb_dim) == (1, 64, 2, 128)
  assert role.checkpoint_dir.endswith("/run/critic/checkpoints/") and config.checkpoint_dir.endswith("/run/checkpoints/")


def test_a_critic_started_from_the_reward_model_takes_its_shape(make_config):
  """ppo.critic_init=auto with a reward model: the critic's config is the reward model's overrides (its checkpoint
  and its depth, here deeper than the policy) with `critic_overrides` on top, so the checkpoint fits the critic."""
  config = make_config(
      "rl.rewards=[reward_model]", "rl.reward_weights=[1.0]", "reward_model_overrides.load_parameters_path=/rm/items",
      "reward_model_overrides.base_num_decoder_layers=4", "critic_overrides.learning_rate=0.003", config_file=PPO,
  )  # fmt: skip
  overrides = ppo.critic_overrides(config, rl_base.reward_model_role(config))
  assert overrides == {"load_parameters_path": "/rm/items", "base_num_decoder_layers": 4, "learning_rate": 0.003}


def test_unknown_or_token_changing_overrides_fail_naming_them(make_config):
  config = make_config("critic_overrides.learning_rat=0.1", config_file=PPO)
  spec = roles.RoleSpec("critic", trained=True, head="scalar", overrides_key="critic_overrides",
                        overrides=dict(config.critic_overrides))  # fmt: skip
  with pytest.raises(ValueError, match=r"Unknown config key critic_overrides\.learning_rat: did you mean "
                     r"'critic_overrides\.learning_rate'"):  # fmt: skip
    roles.role_config(config, spec)
  with pytest.raises(ValueError, match=r"Role reward_model \(reward_model_overrides\) reads other tokens than the "
                     r"policy: vocab_size=1024 \(policy: 512\)"):  # fmt: skip
    roles.role_config(
        config, roles.RoleSpec("reward_model", trained=False, head="scalar", overrides_key="reward_model_overrides",
                               overrides={"vocab_size": 1024})  # fmt: skip
    )

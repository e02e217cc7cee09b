"""PPO with a learned critic: learning, the value's position, resume of both models, warm-up and bad input."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.linen import partitioning as nn_partitioning

from maxtext.utils import maxtext_utils
from maxtext.utils import model_creation_utils
from maxtext_posttrain import forward
from maxtext_posttrain import roles
from maxtext_posttrain import trainer
from maxtext_posttrain.objectives import ppo
from maxtext_posttrain.objectives import rl_base
from tests import run_utils

PPO = "ppo.yml"
TINY = ("per_device_batch_size=2", "rl.num_generations=4", "max_target_length=80", "enable_checkpointing=false")
CHARACTERS = ('rl.rewards=["tests.rewards_for_tests:characters"]', "rl.reward_weights=[1.0]")


def test_ppo_raises_a_learnable_reward_and_its_critic_explains_the_returns(make_config, tmp_path):
  """From random weights, on a reward that varies (characters / 100): the mean reward rises, and the critic comes to
  explain the returns of fresh rollouts (their explained variance, 0 for the fresh critic, rises well above 0). A
  discount (ppo.gamma=0.9) makes a token's return depend on how far it is from the end, which a critic can learn
  from the positions; with gamma = 1 every token of a completion has nearly the same return."""
  metrics_file = tmp_path / "metrics.jsonl"
  config = make_config(
      *TINY, *CHARACTERS, "per_device_batch_size=4", "learning_rate=1e-2", "steps=30", "eval_interval=0",
      "rl.grpo_beta=0", "ppo.gamma=0.9", "critic_overrides.learning_rate=0.003", f"metrics_file={metrics_file}",
      run_utils.WHOLE_TRAIN_SPLIT, config_file=PPO,
  )  # fmt: skip
  run_utils.run(config)
  rows = run_utils.rows(metrics_file)
  rewards = [rows[step]["rl/reward_mean"] for step in range(30)]
  explained = [rows[step]["rl/explained_variance"] for step in range(30)]
  assert np.mean(rewards[-5:]) > np.mean(rewards[:5]) + 0.3, rewards
  assert explained[0] == 0.0 and np.mean(explained[-5:]) > 0.5, explained  # a fresh critic predicts nothing


def _seeded_critic(config, mesh):
  """The critic model of `config` at its seeded init, with a random head (a zero one would read nothing)."""
  init_model, _ = roles.model_initializer(config, roles.RoleSpec("critic", trained=False, head="scalar"), mesh)
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
    model = init_model()
  head = getattr(model, forward.SCALAR_HEAD)
  head.kernel.set_value(jax.random.normal(jax.random.key(1), head.kernel.shape))
  return model


def test_the_value_of_a_token_is_read_at_the_position_before_it(make_config):
  """Rows hold the whole sequence in `inputs`; the value paired with the completion token at column j (the target
  of column j) is the critic's output after reading the tokens up to column j, i.e. up to the token before it. A
  causal decoder's output at the last position of a prefix is its output at that position of the whole row, so
  each value equals the critic's output on the prefix ending right before its token, and not one position later."""
  config = make_config(*TINY, config_file=PPO)
  mesh = maxtext_utils.get_mesh_from_config(config)
  model = _seeded_critic(config, mesh)
  prompt, completion = [1, 40, 41, 42], [50, 51, 52, 2]
  rows = rl_base.training_rows([prompt], [completion], [np.zeros(4)], length=16)
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
    values = forward.scalars(model, rows["inputs"], rows["positions"], rows["segmentation"])
  sequence = prompt + completion
  columns = np.flatnonzero(rows["completion_mask"][0])
  for k, column in enumerate(columns):
    assert rows["targets"][0, column] == completion[k]
    before = sequence[: len(prompt) + k]  # every token before completion token k
    with jax.set_mesh(mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
      prefix = forward.scalars(
          model, jnp.asarray([before]), jnp.arange(len(before))[None], jnp.ones((1, len(before)), jnp.int32)
      )
    np.testing.assert_allclose(values[0, column], prefix[0, -1], rtol=1e-5, atol=1e-6)
    assert abs(float(values[0, column + 1]) - float(prefix[0, -1])) > 1e-4  # one position later reads the token too


def test_a_critic_holds_no_output_projection_and_computes_maxtexts_values(make_config):
  """A scalar-head model leaves out MaxText's (untied) output projection: its params lack `decoder/logits_dense`,
  and its values equal the head applied to MaxText's own model's final normalised hidden state, computed by a plain
  MaxText model (output projection included) holding the same weights."""
  config = make_config(*TINY, config_file=PPO)
  mesh = maxtext_utils.get_mesh_from_config(config)
  critic = _seeded_critic(config, mesh)
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
    plain = model_creation_utils.from_pretrained(config, mesh)  # the seeded init, MaxText's model as it builds it
  params = nnx.state(critic, nnx.Param).to_pure_dict()
  assert "logits_dense" not in params["decoder"] and "logits_dense" in nnx.state(plain, nnx.Param)["decoder"]
  head = getattr(critic, forward.SCALAR_HEAD)
  nnx.update(plain, nnx.state(critic, nnx.Param).filter(nnx.Not(nnx.PathContains(forward.SCALAR_HEAD))))
  tokens = jax.random.randint(jax.random.key(2), (2, 12), 3, config.vocab_size)
  positions, segmentation = jnp.broadcast_to(jnp.arange(12), (2, 12)), jnp.ones((2, 12), jnp.int32)
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
    values = forward.scalars(critic, tokens, positions, segmentation)
    _, hidden, _ = plain.decoder(plain.token_embedder, tokens, positions, segmentation, deterministic=True)
    normed = np.asarray(plain.decoder.decoder_norm(hidden), np.float64)
  expected = normed @ np.asarray(head.kernel.get_value(), np.float64)[:, 0]
  np.testing.assert_allclose(values, expected, rtol=1e-4, atol=1e-5)


def test_a_resumed_ppo_run_repeats_the_uninterrupted_one(make_config, tmp_path):
  """Killed after step 3, in step 2's save between the critic's checkpoint and the policy's (the policy saves last),
  and resumed: the critic's step 2 is dropped, both models, both optimizers and the controller come back from step
  0, and rewards, policy and value losses and the adaptive KL coefficient equal the uninterrupted run's. Each rollout
  batch is two minibatch steps, so the resumed step 1 trains the second minibatch of step 0's batch, whose rows were
  saved with step 0's checkpoint; the KL term is in the loss (ppo.kl_penalty=loss), its coefficient a batch column."""
  common = (*TINY, *CHARACTERS, "enable_checkpointing=true", "checkpoint_period=2", "eval_interval=0")
  common += ("async_checkpointing=false", "learning_rate_schedule_steps=6", "learning_rate=1e-2", "rl.grpo_beta=0.1")
  common += ("ppo.adaptive_kl=true", "ppo.kl_target=0.01", "ppo.kl_horizon=100", "critic_overrides.learning_rate=0.01")
  common += ("ppo.num_minibatches=2", "ppo.kl_penalty=loss")

  def run(name, *overrides):
    metrics_file = tmp_path / f"{name}.jsonl"
    run_utils.run(make_config(*common, *overrides, f"metrics_file={metrics_file}", run_name=name, config_file=PPO))
    return run_utils.rows(metrics_file)

  full = run("full", "steps=6")
  run("split", "steps=4", "save_checkpoint_on_completion=false")  # dies after step 3; its last checkpoint is step 2's
  shutil.rmtree(tmp_path / "split" / "checkpoints" / "2")  # ... of which only the critic's was complete
  split = run("split", "steps=6")
  assert sorted(int(p.name) for p in (tmp_path / "split" / "critic" / "checkpoints").iterdir()) == [0, 2, 4, 5]
  assert sorted(split) == sorted(full) == list(range(6))
  assert [split[s]["rl/minibatch"] for s in range(6)] == [full[s]["rl/minibatch"] for s in range(6)] == [0, 1] * 3
  coefficients = [full[step]["rl/kl_coef"] for step in (0, 2, 4)]  # logged by the steps that draw a batch
  assert len(set(coefficients)) == 3, coefficients  # the controller moves
  for key in ("rl/reward_mean", "rl/kl_coef", "rl/explained_variance"):
    assert [split[s].get(key) for s in range(6)] == [full[s].get(key) for s in range(6)], key
  for key in ("learning/loss", "learning/kl", "critic/loss", "critic/grad_norm"):
    assert [split[s][key] for s in range(6)] == [full[s][key] for s in range(6)], key


def test_critic_warmup_holds_the_policy(make_config, tmp_path):
  """During ppo.critic_warmup_steps only the critic steps: the policy keeps its starting weights and optimizer step;
  the critic's figures are logged in rows without a policy loss."""
  metrics_file = tmp_path / "metrics.jsonl"
  config = make_config(
      *TINY, *CHARACTERS, "steps=2", "eval_interval=0", "rl.grpo_beta=0", "ppo.critic_warmup_steps=2",
      f"metrics_file={metrics_file}", config_file=PPO,
  )  # fmt: skip
  loop, _ = run_utils.run(config)
  start = trainer.setup(config)  # the same seeded starting point, not trained
  jax.tree.map(
      np.testing.assert_array_equal,
      jax.device_get(nnx.state(loop.policy(), nnx.Param).to_pure_dict()),
      jax.device_get(nnx.state(start.policy(), nnx.Param).to_pure_dict()),
  )
  assert int(loop.trained["policy"].state.optimizer.step.get_value()) == 0
  assert int(loop.trained["critic"].state.optimizer.step.get_value()) == 2
  rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
  warmup = [row for row in rows if "critic/loss" in row]
  assert [row["step"] for row in warmup] == [0, 1] and not any("learning/loss" in row for row in warmup), rows


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("ppo.num_minibatches=3",), r"ppo.num_minibatches=3 does not divide the 8 rollouts"),
        (("ppo.critic_init=reward_model",), "needs a reward model"),
        (("ppo.adaptive_kl=true", "rl.grpo_beta=0"), r"ppo.adaptive_kl=true scales .* set rl.grpo_beta > 0"),
        (
            ("ppo.critic_warmup_steps=1", "rl.num_iterations=2", "checkpoint_period=2"),
            "critic_warmup_steps=1 must be a multiple",
        ),
    ],
)
def test_impossible_ppo_settings_fail_naming_the_key(make_config, overrides, message):
  with pytest.raises(ValueError, match=message):
    ppo.PPO(make_config(*TINY, *overrides, config_file=PPO))


@pytest.mark.parametrize(
    "overrides, source",
    [
        (("load_parameters_path=/sft/items",), "/sft/items (ppo.critic_init=auto: policy)"),
        (("ppo.critic_init=fresh",), "a seeded initialisation (ppo.critic_init=fresh)"),
        (("critic_overrides.load_parameters_path=/rm/items",), "/rm/items (critic_overrides.load_parameters_path)"),
    ],
)
def test_the_log_says_where_the_critic_starts(make_config, monkeypatch, overrides, source):
  lines = []
  monkeypatch.setattr(ppo.max_logging, "log", lines.append)
  ppo.PPO(make_config(*TINY, *overrides, config_file=PPO))
  assert f"Role critic: a trained scalar-head model from {source}." in lines


def test_a_critic_config_with_a_feature_the_step_lacks_fails_naming_its_overrides(make_config):
  config = make_config(*TINY, "critic_overrides.mtp_num_layers=1", config_file=PPO)
  with pytest.raises(ValueError, match=r"critic_overrides: The post-training loop does not support yet: multi-token"):
    trainer.setup(config)


def test_a_negative_clip_fails_naming_the_key(make_config):
  with pytest.raises(ValueError, match=r"ppo\.value_clip"):
    make_config(*TINY, "ppo.value_clip=-0.1", config_file=PPO)


def test_a_critic_checkpoint_of_another_shape_fails_naming_the_path(make_config, tmp_path, sft_checkpoint):
  """The critic starts from the policy's checkpoint by default; a critic config of another width cannot read it:
  the error names the checkpoint and the first differing weights, and nothing is written."""
  config = make_config(
      *TINY, f"load_parameters_path={sft_checkpoint}", "critic_overrides.base_emb_dim=64", "steps=1",
      config_file=PPO,
  )  # fmt: skip
  expected = rf"Role critic: the checkpoint at {sft_checkpoint} does not hold the weights this config builds:\n  "
  expected += r"decoder/decoder_norm/scale: checkpoint \(128,\) vs model \(64,\)"
  with pytest.raises(ValueError, match=expected):
    trainer.setup(config)
  assert not (tmp_path / "run" / "critic" / "checkpoints").exists()


def test_non_finite_values_stop_the_step_naming_it(make_config, monkeypatch):
  """A critic whose values are NaN stops the rollout with the step number and the quantity; no step is taken."""
  config = make_config(*TINY, *CHARACTERS, "steps=2", "eval_interval=0", "rl.grpo_beta=0", config_file=PPO)
  loop = trainer.setup(config)
  monkeypatch.setattr(loop.objective, "_values", lambda model, batch: jnp.full(batch["inputs"].shape, jnp.nan))
  with pytest.raises(FloatingPointError, match=r"PPO step 0: the rollout's values are not finite"):
    loop.objective.before_step(loop, loop.train_batches.load_next_batch())
  assert int(loop.trained["policy"].state.optimizer.step.get_value()) == 0


def test_critic_checkpoints_beside_the_policy_and_keeps_the_policy_layout(make_config, tmp_path):
  """The policy's checkpoints stay at <run>/checkpoints (load_parameters_path and export read them); the critic's
  are <run>/critic/checkpoints at the same steps, with MaxText's params less the output projection, plus the scalar
  head."""
  config = make_config(
      *TINY, *CHARACTERS, "steps=2", "eval_interval=0", "enable_checkpointing=true", "checkpoint_period=1",
      "async_checkpointing=false", config_file=PPO,
  )  # fmt: skip
  run_utils.run(config)
  run_dir = tmp_path / "run"
  assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["0", "1"]
  assert sorted(p.name for p in (run_dir / "critic" / "checkpoints").iterdir()) == ["0", "1"]
  from maxtext_posttrain import checkpoint_guard  # pylint: disable=import-outside-toplevel

  critic = checkpoint_guard.stored_params(str(run_dir / "critic" / "checkpoints" / "1" / "items"))
  policy = checkpoint_guard.stored_params(str(run_dir / "checkpoints" / "1" / "items"))
  assert forward.has_scalar_head(critic) and not forward.has_scalar_head(policy)
  assert set(critic) - set(policy) == {forward.SCALAR_HEAD}
  assert set(policy["decoder"]) - set(critic["decoder"]) == {"logits_dense"}


def test_a_lora_critic_trains_its_adapters_and_head_over_a_frozen_base(make_config):
  """`lora_roles=[policy,critic]`: the critic's base stays bit-identical, its head and adapters move, and its
  adapter checkpoint (adapters, head and their optimizer state) resumes the run."""
  common = (*TINY, *CHARACTERS, "eval_interval=0", "enable_checkpointing=true", "checkpoint_period=2")
  common += ("async_checkpointing=false", "lora.enable_lora=true", "lora.lora_rank=4", "lora.lora_alpha=8")
  common += ("lora_roles=[policy,critic]", "critic_overrides.learning_rate=0.01")
  loop = trainer.setup(make_config(*common, "steps=2", config_file=PPO))
  base = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam), nnx.Not(nnx.PathContains(forward.SCALAR_HEAD)))
  start = jax.device_get(loop.trained["critic"].state.model.filter(base).to_pure_dict())
  adapters = jax.device_get(loop.trained["critic"].state.model.filter(nnx.LoRAParam).to_pure_dict())
  trainer.train(loop)  # saves steps 0 and 1 (the final step)
  critic = loop.trained["critic"].state.model
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(critic.filter(base).to_pure_dict()), start)
  moved = jax.tree.map(
      lambda a, b: not np.array_equal(a, b), jax.device_get(critic.filter(nnx.LoRAParam).to_pure_dict()), adapters
  )
  assert any(jax.tree.leaves(moved)) and float(jnp.abs(critic.scalar_head.kernel.get_value()).max()) > 0
  resumed = trainer.setup(make_config(*common, "steps=3", config_file=PPO))
  assert resumed.start_step == 2 and int(resumed.trained["critic"].state.optimizer.step.get_value()) == 2
  np.testing.assert_array_equal(
      jax.device_get(resumed.trained["critic"].state.model.scalar_head.kernel.get_value()),
      jax.device_get(critic.scalar_head.kernel.get_value()),
  )
  jax.tree.map(
      np.testing.assert_array_equal,
      jax.device_get(resumed.trained["critic"].state.model.filter(base).to_pure_dict()),
      start,
  )


def test_ppo_samples_every_prompt_the_iterator_loads(make_config):
  """PPO's rollout batch is global_batch_size_to_load prompts x G, as the GRPO family's and the prompt iterator's:
  where MaxText loads more rows than it trains on (expansion_factor_real_data here; per_device_batch_size < 1 on
  several devices), a batch sized from global_batch_size_to_train_on would leave sampled rows out of every epoch."""
  config = make_config(*TINY, "expansion_factor_real_data=2", "ppo.num_minibatches=2", config_file=PPO)
  assert config.global_batch_size_to_load == 2 * config.global_batch_size_to_train_on
  objective = ppo.PPO(config)
  assert objective.minibatch_rows * 2 == config.global_batch_size_to_load * 4  # rl.num_generations=4
  assert objective.rows_per_example == 2  # a step trains one of the 2 minibatches

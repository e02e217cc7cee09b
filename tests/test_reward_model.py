"""Reward models: Bradley-Terry training on the bundled pairs, use as an RL reward, and refused checkpoints."""

import json

import jax
import numpy as np
import pytest

from maxtext_posttrain import checkpoint_guard
from maxtext_posttrain import config as posttrain_config
from maxtext_posttrain import forward
from maxtext_posttrain import trainer
from maxtext_posttrain.data import arithmetic
from maxtext_posttrain.data import preference as preference_data
from tests import run_utils

RM_STEPS = 600
DEEP = f"base_num_decoder_layers={run_utils.DEEP_SFT_LAYERS}"


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory, tfds_dir, deep_sft_checkpoint):
  """A seeded reward model trained from the 4-layer SFT model's decoder (fresh head) on the bundled arithmetic pairs
  with reward_model.yml's recipe, evaluated on 256 held-out pairs at steps 0 and RM_STEPS."""
  out = tmp_path_factory.mktemp("rm")
  argv = ["", "reward_model.yml", "run_name=rm", f"base_output_directory={out}", f"dataset_path={tfds_dir}", DEEP]
  argv += [f"load_parameters_path={deep_sft_checkpoint}", f"steps={RM_STEPS}", f"eval_interval={RM_STEPS}"]
  argv += [f"checkpoint_period={RM_STEPS}", "async_checkpointing=false", f"metrics_file={out / 'metrics.jsonl'}"]
  _, summary = run_utils.run(posttrain_config.initialize(argv))
  return {"summary": summary, "checkpoint": out / "rm" / "checkpoints" / str(RM_STEPS - 1) / "items"}


def test_reward_model_prefers_held_out_chosen_solutions_nine_times_in_ten(reward_model):
  """A fresh (zero) head ties every pair (accuracy exactly 0.5, margin 0); after training the model prefers the
  worked solution to the plausible wrong one (a swapped, miscopied or slipped number) on at least 90% of 256
  held-out pairs. Its checkpoint holds the scalar head and, started from an SFT model's, no output projection."""
  evals = reward_model["summary"]["evals"]
  assert evals[0]["eval/accuracy"] == 0.5 and evals[0]["eval/margin"] == 0.0, evals[0]
  assert evals[RM_STEPS]["eval/accuracy"] >= 0.9 and evals[RM_STEPS]["eval/margin"] > 0, evals[RM_STEPS]
  stored = checkpoint_guard.stored_params(str(reward_model["checkpoint"]))
  assert forward.has_scalar_head(stored) and "logits_dense" not in stored["decoder"]


NUM_PROMPTS = 16
SCORE_KEYS = 4  # the scores before and after training: NUM_PROMPTS x rl.num_generations samples with each of 4 keys


@pytest.fixture(scope="module")
def rl_prompts(tmp_path_factory):
  """A JSONL of the first NUM_PROMPTS bundled training problems: the RL runs below train on these prompts only, 10
  epochs in 40 steps, so that a short run can move the reward model's score on the prompts it trains on (the score
  mostly judges correctness, which a few hundred sampled completions over fresh prompts barely move)."""
  path = tmp_path_factory.mktemp("rl_prompts") / "prompts.jsonl"
  path.write_text("".join(json.dumps(row) + "\n" for row in arithmetic.generate("easy", "train", NUM_PROMPTS, seed=0)))
  return path


def _rl_with_reward_model(make_config, reward_model, sft_checkpoint, rl_prompts, config_file, steps):
  """The 2-layer SFT policy in an RL run on `rl_prompts` (lr 3e-4) whose only reward is the 4-layer reward model."""
  return make_config(
      "per_device_batch_size=4", "rl.num_generations=4", "max_target_length=80", "enable_checkpointing=false",
      "rl.rewards=[reward_model]", "rl.reward_weights=[1.0]", "rl.grpo_beta=0", "eval_interval=0", f"steps={steps}",
      f"reward_model_overrides.load_parameters_path={reward_model['checkpoint']}", f"reward_model_overrides.{DEEP}",
      "grain_file_type=jsonl", f"grain_train_files={rl_prompts}", f"grain_eval_files={rl_prompts}",
      "train_data_columns=[question,answer]", "eval_data_columns=[question,answer]", "learning_rate=3e-4",
      f"load_parameters_path={sft_checkpoint}", config_file=config_file,
  )  # fmt: skip


def _score_gain(loop) -> np.ndarray:
  """Per sample slot (SCORE_KEYS keys x NUM_PROMPTS prompts x rl.num_generations), the reward model's score after
  training `loop` minus its score before: a slot's two completions are drawn with one key, so they differ by the
  training only."""

  def scores() -> np.ndarray:
    step, rewards = loop.step, []
    try:
      for key in range(SCORE_KEYS):
        loop.step = 10**6 + key  # the sampling key is folded from the step
        rewards.append(np.asarray(loop.objective.sample(loop, list(range(NUM_PROMPTS)), 0, None).rewards, np.float64))
    finally:
      loop.step = step
    return np.concatenate(rewards)

  before = scores()
  trainer.train(loop)
  after = scores()
  gain = after - before
  print(
      f"{loop.config.posttrain_mode}: the reward model's mean score {before.mean():.3f} -> {after.mean():.3f}"
      f" (gain {gain.mean():.3f}, standard error {_standard_error(gain):.3f}, {len(gain)} slots)"
  )
  return gain


def _standard_error(values: np.ndarray) -> float:
  """The standard error of the mean of `values` (independent draws)."""
  return float(np.std(values, ddof=1) / np.sqrt(len(values)))


def test_grpo_with_the_reward_model_raises_its_score(make_config, reward_model, sft_checkpoint, rl_prompts):
  """`rl.rewards=[reward_model]`: the frozen reward model scores each rollout at its last token, and 40 GRPO steps
  raise its mean score by more than 3 standard errors of the 256 paired gains (one-sided p < 0.002 for a policy whose
  expected score on these prompts is unchanged; the error is the scoring's sampling noise, not the spread between
  training runs or hosts). The bar is a significance, not a fixed gain: Bradley-Terry fixes only score differences,
  whose scale grows with the reward model's training."""
  config = _rl_with_reward_model(make_config, reward_model, sft_checkpoint, rl_prompts, "grpo.yml", steps=40)
  gain = _score_gain(trainer.setup(config))
  assert gain.mean() > 3 * _standard_error(gain), gain


def test_ppo_with_the_reward_model_starts_its_critic_from_it_and_is_rewarded_by_its_score(
    make_config, reward_model, sft_checkpoint, rl_prompts
):
  """PPO with a reward model: its critic starts from the reward model's checkpoint (ppo.critic_init=auto), head
  included, and each rollout's reward is the reward model's score, logged under its name.

  Whether PPO's 20 steps of `_rl_with_reward_model` (`steps=20`) raise the score has depended on the host's float
  rounding, which decides the reward model itself: with the 800-step recipe of earlier commits, on an AMD EPYC host
  they did for rl.sampling_seed 0, 1 and 2; on an Intel Xeon host they moved it by -0.09, +0.57 and -0.03, the
  critic's explained variance starting at -2.0 (its values, the reward model's scores of each prefix, explained the
  returns worse than a constant). With this file's 600-step reward model, on the AMD EPYC host, they gained +0.78,
  +1.15 and +1.20 over the 256 slots of `_score_gain`. PPO's learning is asserted by tests/test_ppo.py, GRPO's with
  this reward model above."""
  config = _rl_with_reward_model(make_config, reward_model, sft_checkpoint, rl_prompts, "ppo.yml", steps=2)
  loop = trainer.setup(config)
  np.testing.assert_array_equal(
      jax.device_get(loop.trained["critic"].state.model.scalar_head.kernel.get_value()),
      jax.device_get(loop.frozen["reward_model"].state.scalar_head.kernel.get_value()),
  )
  trainer.train(loop)
  metrics = loop.objective.step_metrics
  assert metrics["rl/rewards/reward_model"] == metrics["rl/reward_mean"] and np.isfinite(metrics["rl/reward_mean"])
  assert metrics["rl/reward_mean"] != 0.0  # a fresh (zero) head would score every rollout 0


def test_a_checkpoint_without_a_scalar_head_is_not_a_reward_model(make_config, sft_checkpoint, tmp_path):
  config = make_config(
      "rl.rewards=[reward_model]", "rl.reward_weights=[1.0]", "enable_checkpointing=false",
      f"reward_model_overrides.load_parameters_path={sft_checkpoint}", config_file="grpo.yml",
  )  # fmt: skip
  with pytest.raises(ValueError, match=rf"Role reward_model: the checkpoint at {sft_checkpoint} has no scalar head"):
    trainer.setup(config)
  assert not (tmp_path / "run").exists()


def test_reward_model_needs_its_checkpoint_its_shape_and_the_policys_tokens(make_config, reward_model):
  with pytest.raises(ValueError, match=r"reward_model_overrides.load_parameters_path is not set"):
    trainer.setup(make_config("rl.rewards=[reward_model]", "rl.reward_weights=[1.0]", config_file="grpo.yml"))
  config = make_config(
      "rl.rewards=[reward_model]", "rl.reward_weights=[1.0]", "reward_model_overrides.vocab_size=1024",
      f"reward_model_overrides.load_parameters_path={reward_model['checkpoint']}", f"reward_model_overrides.{DEEP}",
      config_file="grpo.yml",
  )  # fmt: skip
  with pytest.raises(ValueError, match=r"reads other tokens than the policy: vocab_size=1024 \(policy: 512\)"):
    trainer.setup(config)
  config = make_config(  # the 4-layer reward model read as the policy's 2-layer shape
      "rl.rewards=[reward_model]", "rl.reward_weights=[1.0]",
      f"reward_model_overrides.load_parameters_path={reward_model['checkpoint']}", config_file="grpo.yml",
  )  # fmt: skip
  with pytest.raises(ValueError, match=r"Role reward_model: the checkpoint at .* does not hold the weights this config"):
    trainer.setup(config)


def test_a_fourth_column_is_a_per_pair_margin(make_config, tmp_path):
  rows = [
      {"prompt": "Tom has 3 apples and buys 5 more. How many now?", "chosen": "#### 8", "rejected": "#### 9", "m": 1.5},
      {"prompt": "Ann has 2 pens and loses 1. How many now?", "chosen": "#### 1", "rejected": "#### 3", "m": "x"},
  ]
  path = tmp_path / "pairs.jsonl"
  path.write_text("".join(json.dumps(row) + "\n" for row in rows[:1]))
  columns = '["prompt","chosen","rejected","m"]'
  keys = ("grain_file_type=jsonl", f"grain_train_files={path}", f"train_data_columns={columns}")
  examples, _ = preference_data.prepare_pairs(make_config(*keys, config_file="reward_model.yml"), train=True)
  assert examples[0][preference_data.MARGIN] == 1.5
  path.write_text("".join(json.dumps(row) + "\n" for row in rows))
  with pytest.raises(ValueError, match=r"train pair 1 of jsonl:.*column 'm' holds 'x', not a finite number"):
    preference_data.prepare_pairs(make_config(*keys, config_file="reward_model.yml"), train=True)

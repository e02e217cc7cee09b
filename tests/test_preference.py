"""Preference tuning (posttrain_mode=dpo): pair data, the reference role, one-forward loss and learning runs."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from maxtext_posttrain import trainer
from maxtext_posttrain.data import arithmetic
from maxtext_posttrain.data import preference as preference_data
from maxtext_posttrain.objectives import dpo as dpo_objective
from maxtext_posttrain.rewards import math as math_rewards
from tests import run_utils

DPO = "dpo.yml"
PAIRS = [
    {
        "prompt": "Tom has 3 apples and buys 5 more. How many now?",
        "chosen": "3 + 5 = 8\n#### 8",
        "rejected": "3 + 5 = 9\n#### 9",
    },
    {
        "prompt": "Ana has 9 pens and loses 4. How many are left?",
        "chosen": "9 - 4 = 5\n#### 5",
        "rejected": "9 + 4 = 13\n#### 13",
    },
    {
        "prompt": "Bo has 2 cats and gets 2 more. How many now?",
        "chosen": "2 + 2 = 4\n#### 4",
        "rejected": "2 + 2 = 4\n#### 4",
    },
    {
        "prompt": "Eli has 7 cards and gives away 1. How many now?",
        "chosen": "7 - 1 = 6\n#### 6",
        "rejected": "7 - 1 = 6\n#### 7",
    },
]


def _jsonl_config(make_config, tmp_path, rows, *overrides):
  path = tmp_path / "pairs.jsonl"
  path.write_text("".join(json.dumps(row) + "\n" for row in rows))
  columns = '["prompt","chosen","rejected"]'
  return make_config(
      "grain_file_type=jsonl",
      f"grain_train_files={path}",
      f"grain_eval_files={path}",
      f"train_data_columns={columns}",
      f"eval_data_columns={columns}",
      "per_device_batch_size=2",
      *overrides,
      config_file=DPO,
  )


def test_bundled_pairs_prefer_the_correct_worked_answer():
  """Chosen is the generator's worked solution; rejected keeps its format but ends in another, non-negative number."""
  for difficulty in arithmetic.DIFFICULTIES:
    problems = arithmetic.generate(difficulty, "train", 500, seed=0)
    pairs = arithmetic.generate_preferences(difficulty, "train", 500, seed=0)
    assert pairs == arithmetic.generate_preferences(difficulty, "train", 500, seed=0)
    assert [p["question"] for p in pairs] == [p["question"] for p in problems]
    for problem, pair in zip(problems, pairs):
      assert pair["chosen"] == problem["answer"]
      chosen, rejected = math_rewards.gold_answer(pair["chosen"]), math_rewards.gold_answer(pair["rejected"])
      assert rejected is not None and rejected != chosen and int(rejected) >= 0, pair
      assert pair["rejected"].count("\n") == pair["chosen"].count("\n")


def test_pair_rows_weight_exactly_the_completion_targets():
  rows = preference_data.side_arrays([1, 10, 11], [20, 21, 2], length=8, pad_id=0)
  np.testing.assert_array_equal(rows["inputs"], [1, 10, 11, 20, 21, 2, 0, 0])
  np.testing.assert_array_equal(rows["targets"], [10, 11, 20, 21, 2, 0, 0, 0])
  np.testing.assert_array_equal(rows["weights"], [0, 0, 1, 1, 1, 0, 0, 0])  # predicting 20, 21 and eos
  np.testing.assert_array_equal(rows["segmentation"], [1, 1, 1, 1, 1, 1, 0, 0])


def test_identical_pairs_are_skipped_and_counted(make_config, tmp_path):
  config = _jsonl_config(make_config, tmp_path, PAIRS)
  examples, stats = preference_data.prepare_pairs(config, train=True)
  assert (stats.num_examples, stats.num_identical, stats.num_pairs) == (4, 1, 3) and len(examples) == 3
  assert stats.fingerprint == preference_data.prepare_pairs(config, train=True)[1].fingerprint


def test_bad_pairs_fail_naming_file_line_and_field(make_config, tmp_path):
  rows = PAIRS[:2] + [{"prompt": "p", "chosen": "c"}]
  with pytest.raises(ValueError, match=r"pairs.jsonl:3: missing field 'rejected'"):
    preference_data.prepare_pairs(_jsonl_config(make_config, tmp_path, rows), train=True)
  long = [dict(PAIRS[0], chosen="1 + 1 = 2\n" * 60 + "#### 2")]
  with pytest.raises(ValueError, match=r"train pair 0 of jsonl:.*overlong_policy=error"):
    preference_data.prepare_pairs(_jsonl_config(make_config, tmp_path, long, "overlong_policy=error"), train=True)
  _, stats = preference_data.prepare_pairs(_jsonl_config(make_config, tmp_path, long + PAIRS[:1]), train=True)
  assert stats.num_truncated == 1 and stats.num_pairs == 2
  with pytest.raises(ValueError, match=r"reads 3 data columns \['prompt', 'chosen', 'rejected'\]"):
    preference_data.prepare_pairs(_jsonl_config(make_config, tmp_path, PAIRS, 'train_data_columns=["a","b"]'), True)


def test_config_keeps_maxtexts_dpo_keys(make_config):
  """MaxText's post_train/dpo.yml switch (use_dpo) selects the objective; the algorithms and checks extend MaxText's."""
  config = make_config("use_dpo=true", "packing=false", "use_sft=false", config_file="sft.yml")
  assert config.posttrain_mode == "dpo" and not config.use_dpo
  # The objective checks its keys when the loop builds it.
  with pytest.raises(ValueError, match="set packing=false"):
    dpo_objective.Preference(make_config("packing=true", config_file=DPO))
  with pytest.raises(ValueError, match="not dpo.algo=ipo"):
    dpo_objective.Preference(make_config("dpo.algo=ipo", "dpo.dpo_label_smoothing=0.1", config_file=DPO))
  with pytest.raises(ValueError, match="leaves no room"):
    dpo_objective.Preference(make_config("dpo.max_prompt_length=128", config_file=DPO))
  # Precomputing scores the training pairs only; the held-out loss pass would find no reference log-probs.
  with pytest.raises(ValueError, match="set eval_interval=0, or precompute_reference_logprobs=false"):
    dpo_objective.Preference(make_config("dpo.precompute_reference_logprobs=true", config_file=DPO))


def test_reference_equals_the_starting_policy_and_both_sides_share_one_forward(make_config):
  """At step 0 the loss is log 2 with zero implicit rewards, and the policy runs once per batch over 2B rows."""
  loop = trainer.setup(make_config("steps=1", "eval_interval=0", "enable_checkpointing=false", config_file=DPO))
  batch = loop.objective.before_step(loop, loop.train_batches.load_next_batch())
  pairs = loop.objective.step_examples(loop.step, batch)  # what a non-finite step's error names: the batch's pairs
  assert (
      len(pairs) == loop.config.global_batch_size_to_train_on
      and pairs[-1] < loop.data.description["train"]["num_examples"]
  )
  calls = []

  class CountingModel:
    """The real MaxText model, recording the batch size of every forward it is asked for."""

    def __init__(self, model):
      self.model = model

    def __call__(self, **kwargs):
      calls.append(kwargs["decoder_input_tokens"].shape)
      return self.model(**kwargs)

  out = loop.objective.loss(CountingModel(loop.policy()), batch, is_train=False)
  pairs, length = batch["chosen_inputs"].shape
  assert calls == [(2 * pairs, length)]
  assert float(out.weight) == pairs
  np.testing.assert_allclose(float(out.total) / pairs, np.log(2.0), rtol=1e-5)
  for key in ("rewards/chosen", "rewards/rejected", "rewards/margin"):
    assert abs(float(out.metrics[key])) / pairs < 1e-4, (key, out.metrics[key])


def _preference_run(make_config, tmp_path, *overrides):
  """(eval before, eval after) of a seeded preference run on the bundled pairs, in rows of reward_model.yml's length
  (the pairs are at most 60 tokens, prompts at most 45: nothing is cut, and the padding dpo.yml's 128 would add is
  masked anyway)."""
  config = make_config(
      run_utils.WHOLE_TRAIN_SPLIT,
      "enable_checkpointing=false",
      "eval_steps=8",
      "max_target_length=64",
      "dpo.max_prompt_length=48",
      f"metrics_file={tmp_path / 'metrics.jsonl'}",
      *overrides,
      config_file=DPO,
  )
  _, summary = run_utils.run(config)
  with open(tmp_path / "metrics.jsonl", encoding="utf-8") as f:
    data = next(row for row in map(json.loads, f) if "data/train/num_truncated" in row)
  assert data["data/train/num_truncated"] == data["data/eval/num_truncated"] == 0, data
  evals = summary["evals"]
  return evals[min(evals)], evals[max(evals)]


def test_dpo_raises_held_out_preference_accuracy(make_config, tmp_path, sft_checkpoint):
  before, after = _preference_run(
      make_config, tmp_path, f"load_parameters_path={sft_checkpoint}", "steps=150", "eval_interval=150"
  )
  assert 0.4 <= before["eval/rewards/accuracy"] <= 0.6, before  # policy == reference: every pair a tie
  assert after["eval/rewards/accuracy"] >= 0.9, after
  assert after["eval/rewards/margin"] > 0.5 and after["eval/loss"] < 0.4, after


@pytest.mark.parametrize("algo", ["orpo", "simpo"])
def test_reference_free_algorithms_raise_preference_accuracy(make_config, tmp_path, algo):
  """ORPO and SimPO need no reference and no SFT stage: from random weights they too move accuracy off chance."""
  before, after = _preference_run(
      make_config, tmp_path, f"dpo.algo={algo}", "learning_rate=3e-3", "steps=75", "eval_interval=75"
  )
  assert before["eval/rewards/accuracy"] <= 0.6, before
  assert after["eval/rewards/accuracy"] >= before["eval/rewards/accuracy"] + 0.15, (before, after)
  assert after["eval/rewards/margin"] > before["eval/rewards/margin"], (before, after)


def test_precomputed_reference_logprobs_train_like_the_reference_model(make_config, tmp_path):
  """One scoring pass at setup gives the same steps as a reference forward per step."""
  common = ("steps=3", "eval_interval=0", "enable_checkpointing=false", "per_device_batch_size=4")
  losses = {}
  for precompute in ("false", "true"):
    metrics = tmp_path / f"{precompute}.jsonl"
    # 12 distinct training pairs (the identical pair is skipped), so the pass at setup scores 3 batches.
    config = _jsonl_config(
        make_config,
        tmp_path,
        [dict(pair, prompt=f"{pair['prompt']} ({i})") for i in range(4) for pair in PAIRS],
        *common,
        f"dpo.precompute_reference_logprobs={precompute}",
        f"metrics_file={metrics}",
    )
    loop, _ = run_utils.run(config)
    assert (loop.frozen == {}) == (precompute == "true")
    losses[precompute] = run_utils.losses(metrics)
  np.testing.assert_allclose(list(losses["true"].values()), list(losses["false"].values()), rtol=1e-5)
  assert not np.allclose(list(losses["true"].values()), np.log(2.0))  # the policy did move


def test_lora_reference_over_restored_adapters_is_the_starting_policy(make_config, tmp_path):
  """DPO from SFT adapters (`lora.lora_restore_path`): the reference is base + those adapters, followed or as a
  precomputing copy, so the first loss is exactly log 2 (the base alone as reference would not give it)."""
  lora_keys = ("lora.enable_lora=true", "lora.lora_rank=4", "lora.lora_alpha=8.0")
  sft = make_config(*lora_keys, "steps=3", "learning_rate=1e-2", "eval_interval=0", "async_checkpointing=false",
                    run_name="sft")  # fmt: skip
  sft_loop, _ = run_utils.run(sft)
  trained = jax.device_get(nnx.state(sft_loop.policy(), nnx.LoRAParam).to_pure_dict())
  assert all(np.any(b) for b in jax.tree.leaves(trained)), "B starts at 0: unmoved adapters would prove nothing"
  restore = f"lora.lora_restore_path={tmp_path / 'sft' / 'checkpoints' / '2' / 'items'}"
  rows = [dict(pair, prompt=f"{pair['prompt']} ({i})") for i in range(4) for pair in PAIRS]
  for precompute in ("false", "true"):
    metrics = tmp_path / f"{precompute}.jsonl"
    config = _jsonl_config(
        make_config, tmp_path, rows, *lora_keys, restore, "steps=1", "eval_interval=0", "enable_checkpointing=false",
        f"metrics_file={metrics}", f"dpo.precompute_reference_logprobs={precompute}",
    )  # fmt: skip
    loop, _ = run_utils.run(config)
    np.testing.assert_allclose(run_utils.losses(metrics)[0], np.log(2.0), rtol=1e-5)
    if precompute == "false":
      reference = jax.device_get(loop.role("reference").state.filter(nnx.LoRAParam).to_pure_dict())
      jax.tree.map(np.testing.assert_array_equal, reference, trained)


def test_lora_reference_is_the_policy_with_adapters_off(make_config, tmp_path):
  """Under LoRA no reference copy is built; the adapters-off policy gives log 2 at step 0, and the adapters' training
  moves the loss off log 2 at every later step (a reference that followed the adapters would give log 2 throughout;
  from random weights 10 steps do not yet lower it)."""
  metrics = tmp_path / "metrics.jsonl"
  config = make_config(
      "lora.enable_lora=true",
      "lora.lora_rank=4",
      "lora.lora_alpha=8.0",
      "learning_rate=1e-2",
      "steps=10",
      "eval_interval=0",
      "enable_checkpointing=false",
      f"metrics_file={metrics}",
      config_file=DPO,
  )
  loop, _ = run_utils.run(config)
  assert loop.frozen["reference"].follows_policy
  losses = run_utils.losses(metrics)
  np.testing.assert_allclose(losses[0], np.log(2.0), rtol=1e-5)
  assert all(abs(losses[step] - np.log(2.0)) > 1e-3 for step in range(1, 10)), losses
  reference = loop.role("reference")
  adapters = jax.tree.leaves(reference.state.filter(lambda path, v: "lora" in str(path).lower()))
  assert adapters and all(not np.any(np.asarray(a)) for a in adapters)
  assert dpo_objective.REFERENCE_KEYS[0] in loop.objective.batch_keys

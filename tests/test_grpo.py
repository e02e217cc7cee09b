"""The GRPO family (posttrain_mode=grpo, drgrpo, dapo, gspo, gspo_token, rloo): config presets, rollout rows,
sampler/trainer agreement, inner iterations, dynamic sampling, and seeded runs that raise the reward."""

import json
import logging
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.linen import partitioning as nn_partitioning

from maxtext_posttrain import config as config_lib
from maxtext_posttrain import mesh as mesh_lib
from maxtext_posttrain import objectives
from maxtext_posttrain import trainer
from maxtext_posttrain.losses import policy_gradient
from maxtext_posttrain.objectives import grpo
from maxtext_posttrain.objectives import rl_base
from maxtext_posttrain.rewards import shaping
from tests import run_utils

GRPO = "grpo.yml"
# Small rollouts from scratch: 2 prompts x 4 samples, short completions.
TINY = ("per_device_batch_size=2", "rl.num_generations=4", "max_target_length=80", "enable_checkpointing=false")
# A reward with variance even under random weights: the length of a completion in characters.
CHARACTERS = ('rl.rewards=["tests.rewards_for_tests:characters"]', "rl.reward_weights=[1.0]")
# Sampling ahead on the one test device: trainer and sampler share it (MaxText's fractions default to halves).
AHEAD = ("rl.off_policy_steps=1", "trainer_devices_fraction=1", "sampler_devices_fraction=1")


def _metrics(path) -> dict[int, dict]:
  return {int(row["step"]): row for row in map(json.loads, path.read_text().splitlines()) if "learning/loss" in row}


def test_modes_are_presets_of_maxtexts_rl_keys_and_a_set_key_wins(make_config):
  assert set(config_lib.RL_PRESETS) <= set(objectives.names())
  dapo = make_config("posttrain_mode=dapo", config_file=GRPO).rl
  assert (dapo.loss_agg_mode, dapo.epsilon_high, dapo.dynamic_sampling, dapo.grpo_beta) == ("token-mean", 0.28, True, 0)
  assert dapo.overlong_buffer_length == (96 - 64) // 4  # a quarter of the generation budget, in tokens
  drgrpo = make_config("posttrain_mode=drgrpo", config_file=GRPO).rl
  assert (drgrpo.scale_rewards, drgrpo.loss_agg_mode) == (False, "sequence-mean-token-scale")
  gspo_token = make_config("posttrain_mode=gspo_token", "rl.grpo_beta=0.02", config_file=GRPO).rl
  assert (gspo_token.loss_algo, gspo_token.grpo_epsilon, gspo_token.grpo_beta) == ("gspo-token", 3e-4, 0.02)
  assert make_config("posttrain_mode=rloo", config_file=GRPO).rl.advantage_estimator == "rloo"
  # MaxText's own spelling of GSPO-token and of the aggregation modes; epsilon_high defaults to grpo_epsilon.
  rl = make_config("rl.loss_algo=gspo-token", "rl.loss_agg_mode=token-mean", config_file=GRPO).rl
  assert (rl.loss_algo, rl.epsilon_high) == ("gspo-token", 0.2)
  assert grpo.GRPO(make_config("rl.loss_algo=gspo-token", config_file=GRPO)).algo == "gspo_token"


@pytest.mark.parametrize(
    "spelling, mode",
    [
        # Tunix's spellings (tunix/rl/common.py aggregate_loss), where MaxText's rl.yml sends rl.loss_agg_mode.
        ("token-mean", "token-mean"),
        ("sequence-mean-token-mean", "seq-mean-token-mean"),
        ("sequence-mean-token-scale", "seq-mean-token-sum-norm"),  # per-sequence sums over the generation budget
        ("seq-mean-token-sum", "seq-mean-token-sum"),
        ("sequence-mean-token-sum-norm", "seq-mean-token-sum"),  # Tunix's norm defaults to the non-empty sequences
        # verl's (verl/trainer/ppo/core_algos.py agg_loss).
        ("seq-mean-token-mean", "seq-mean-token-mean"),
        ("seq-mean-token-sum-norm", "seq-mean-token-sum-norm"),
    ],
)
def test_loss_agg_mode_spellings_resolve_to_their_librarys_mode(make_config, spelling, mode):
  objective = grpo.GRPO(make_config(f"rl.loss_agg_mode={spelling}", config_file=GRPO))
  assert (objective.agg_mode, objective.max_new_tokens) == (mode, 96 - 64)


@pytest.mark.parametrize("spelling", ["sequence-mean", "sequence-mean-token-sum"])
def test_loss_agg_mode_spellings_no_library_defines_are_refused(make_config, spelling):
  """MaxText's types.py lists `sequence-mean`, which Tunix's aggregate_loss refuses; neither Tunix nor verl spells
  `sequence-mean-token-sum`."""
  with pytest.raises(ValueError, match="loss_agg_mode"):
    make_config(f"rl.loss_agg_mode={spelling}", config_file=GRPO)


def test_drgrpo_divides_each_completions_token_sum_by_the_generation_budget(make_config):
  """Dr.GRPO (Liu et al. 2025): 1/G sum_i sum_t loss_it / MAX_TOKENS, MAX_TOKENS the generation budget (96 - 64)."""
  objective = grpo.GRPO(make_config("posttrain_mode=drgrpo", config_file=GRPO))
  rng = np.random.default_rng(0)
  values = rng.normal(size=(4, 96)).astype(np.float32)
  mask = np.zeros((4, 96), np.float32)
  for row, length in enumerate([32, 5, 17, 1]):
    mask[row, 64 : 64 + length] = 1
  total, weight = policy_gradient.aggregate(values, mask, objective.agg_mode, objective.max_new_tokens)
  np.testing.assert_allclose(total / weight, np.mean(np.sum(values * mask, axis=1) / 32), rtol=1e-5)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("rl.num_generations=1",), "needs at least 2 completions per prompt"),
        (("packing=true",), "set packing=false"),
        (("rl.overlong_buffer_length=32",), "below the generation budget"),
        (("max_target_length=64",), "leaves none"),
        (("rl.use_agentic_rollout=true",), "does not support rl.use_agentic_rollout"),
        (("rl.grpo_beta=-0.1",), r"rl.grpo_beta=-0.1: the KL coefficient must be >= 0"),
        (("rl.off_policy_steps=-1",), "rl.off_policy_steps=-1 must be >= 0"),
        (("rl.off_policy_steps=1", "rl.use_rollout_logps=false"), "needs rl.use_rollout_logps=true"),
        (("rl.off_policy_steps=1", "rl.force_on_policy_ratio=true"), "force_on_policy_ratio=true pins the ratio"),
        (("rl.dual_clip=3", "rl.loss_algo=gspo"), "dual_clip applies to rl.loss_algo=grpo"),
        (("rl.reference_devices=sampler",), r"but this run has no reference \(rl.grpo_beta=0\)"),
        (
            ("rl.reference_devices=sampler", "rl.grpo_beta=0.1", 'rl.tools=["calculator"]'),
            r"but rl.tools=\['calculator'\] finish rollouts on the host",
        ),
        (
            ("rl.reference_devices=sampler", "rl.grpo_beta=0.1", "lora.enable_lora=true", "lora.lora_rank=8"),
            "but under LoRA the reference is the policy's base",
        ),
        (("rl.reward_weights=[1.0]",), "one weight per reward"),
        (("eval_pass_at_k=[1,16]",), "k <= eval_samples_per_prompt=8"),
        (("rl.dynamic_sampling_metric=accuracy",), "rl.dynamic_sampling_metric='accuracy': expected 'shaped_reward'"),
        (("rl.dynamic_sampling_metric=correctness",), "applies with rl.dynamic_sampling=true"),
        (
            ('rl.rewards=["no_such_module:fn"]', "rl.reward_weights=[1.0]"),
            r"rl.rewards=\['no_such_module:fn'\]: Reward 'no_such_module:fn': cannot import module 'no_such_module'",
        ),
    ],
)
def test_bad_rl_settings_fail_naming_the_key(make_config, overrides, message):
  """The GRPO objective checks its rl.* keys when the loop builds it, before any model or data; the command line
  prints these errors in one line (ConfigError)."""
  with pytest.raises(config_lib.ConfigError, match=message):
    grpo.GRPO(make_config(*overrides, config_file=GRPO))


def test_device_rows_are_the_training_rows_of_a_decode_programs_arrays():
  """`rl_base.device_rows` (rl.reference_devices=sampler) builds, on the devices, from right-padded prompts and
  padded completions, the rows `training_rows` builds on the host: the reference scores the same rows either way."""
  rng = np.random.default_rng(0)
  bucket, new_tokens, length = 8, 6, 14
  # A prompt and a completion that fill the row; a 1-token completion; a batch-padding row (one token each); others.
  prompt_lengths = np.array([8, 8, 3, 5, 1, 2], np.int32)
  lengths = np.array([6, 1, 4, 6, 1, 3], np.int32)
  prompt_tokens = np.zeros((6, bucket), np.int32)
  tokens = np.zeros((6, new_tokens), np.int32)
  for row in range(6):
    prompt_tokens[row, : prompt_lengths[row]] = rng.integers(1, 100, prompt_lengths[row])
    tokens[row, : lengths[row]] = rng.integers(1, 100, lengths[row])
  prompts = [list(prompt_tokens[r, : prompt_lengths[r]]) for r in range(6)]
  completions = [list(tokens[r, : lengths[r]]) for r in range(6)]
  host = rl_base.training_rows(prompts, completions, None, length, window=new_tokens)
  device = jax.jit(rl_base.device_rows, static_argnums=4)(prompt_tokens, prompt_lengths, tokens, lengths, length)
  assert set(device) == set(host)
  for key, value in host.items():
    np.testing.assert_array_equal(device[key], value, err_msg=key)


def test_training_rows_put_sampler_logprobs_on_the_completion_targets():
  rows = rl_base.training_rows([[1, 10, 11]], [[20, 21, 2]], [np.array([-0.5, -0.25, -0.125, 0.0])], length=8)
  np.testing.assert_array_equal(rows["inputs"][0], [1, 10, 11, 20, 21, 0, 0, 0])
  np.testing.assert_array_equal(rows["targets"][0], [10, 11, 20, 21, 2, 0, 0, 0])
  np.testing.assert_array_equal(rows["completion_mask"][0], [0, 0, 1, 1, 1, 0, 0, 0])  # predicting 20, 21, eos
  np.testing.assert_array_equal(rows["old_logps"][0], [0, 0, -0.5, -0.25, -0.125, 0, 0, 0])
  np.testing.assert_array_equal(rows["segmentation"][0], [1, 1, 1, 1, 1, 0, 0, 0])


def test_overlong_penalty_ramps_over_the_buffer_in_tokens():
  lengths = np.array([0, 24, 25, 28, 31, 32, 40])
  np.testing.assert_allclose(
      shaping.overlong_penalty(lengths, max_length=32, buffer_length=8, penalty=0.5),
      [0, 0, -0.5 / 8, -0.5 * 4 / 8, -0.5 * 7 / 8, -0.5, -0.5],
  )
  np.testing.assert_array_equal(shaping.overlong_penalty(lengths, 32, 0), 0)
  with pytest.raises(ValueError, match="buffer_length=32"):
    shaping.overlong_penalty(lengths, 32, 32)


def test_dynamic_sampling_keeps_informative_groups_and_masks_the_unfilled_slots():
  # Informative groups first, in sampling order; uninformative ones fill what is left, and are masked out.
  assert grpo.select([False, True, False, True], 2) == ([1, 3], 0)
  assert grpo.select([False, True, False, True, True], 2) == ([1, 3], 0)
  assert grpo.select([False, True, False], 3) == ([1, 0, 2], 2)


def test_dynamic_sampling_over_processes_chooses_the_batch_one_process_would(monkeypatch):
  """`GRPO._block` on 3 simulated processes (threads; `gathered` concatenates their values in process order, as the
  all-gather does), 2 prompts each, 3 rounds, random informative groups: the blocks together are the batch one process
  chooses from all the groups (`select` in round-major, batch order), each group intact whichever process sampled it
  (in most cases some group changes process), and each process masks the filler at the whole batch's tail."""
  processes, prompts, rounds = 3, 2, 3
  local, barrier, slots = threading.local(), threading.Barrier(processes), [None] * processes

  def gathered(values):
    slots[local.process] = np.asarray(values)
    barrier.wait()
    out = np.concatenate(slots)
    barrier.wait()
    return out

  monkeypatch.setattr(jax, "process_count", lambda: processes)
  monkeypatch.setattr(jax, "process_index", lambda: local.process)
  monkeypatch.setattr(grpo, "gathered", gathered)
  objective = object.__new__(grpo.GRPO)
  objective.rl = types.SimpleNamespace(dynamic_sampling=True, num_generations=2, reference_devices="trainer")
  objective.config, objective.max_new_tokens = types.SimpleNamespace(max_prefill_predict_length=4), 3
  total, moved = processes * prompts, 0
  for seed in range(40):
    informative = np.random.default_rng(seed).random((rounds, processes, prompts)) < 0.3

    def group(index, flag):  # prompt `index`'s group, its contents derived from the index
      scores = np.array([0.0, 1.0] if flag else [1.0, 1.0], np.float32)
      logprobs = [np.array([-index / 10], np.float32), np.zeros(0, np.float32)]
      make = grpo._Group  # pylint: disable=protected-access
      return make(index, [index % 7 + 1], [[index % 5 + 1], []], logprobs, scores, scores)

    blocks = [None] * processes

    def run(process, informative=informative, blocks=blocks):
      local.process = process
      groups = [
          group(r * total + process * prompts + j, informative[r, process, j])
          for r in range(rounds)
          for j in range(prompts)
      ]
      blocks[process] = objective._block(groups, prompts)  # pylint: disable=protected-access

    threads = [threading.Thread(target=run, args=(p,)) for p in range(processes)]
    for thread in threads:
      thread.start()
    for thread in threads:
      thread.join()
    chosen, masked = grpo.select(informative.reshape(-1), total)  # index r * total + p * prompts + j: that order
    assert [g.index for block, _, _ in blocks for g in block] == chosen
    assert [masked_here for _, masked_here, _ in blocks] == [
        sum(i >= total - masked for i in range(p * prompts, (p + 1) * prompts)) for p in range(processes)
    ]
    assert all(whole == masked for _, _, whole in blocks)
    for block, _, _ in blocks:
      for g in block:
        assert (g.prompt, g.completions, g.logprobs[0].tolist()) == (
            [g.index % 7 + 1],
            [[g.index % 5 + 1], []],
            [np.float32(-g.index / 10)],
        )
    moved += any((g.index % total) // prompts != p for p, (block, _, _) in enumerate(blocks) for g in block)
  assert moved > 20


def test_groups_travel_between_processes_as_they_were_sampled():
  """Dynamic sampling moves groups between processes as fixed-shape arrays (`_pack`, padded to a number of groups):
  a group comes out as it went in, whatever its prompt's and completions' lengths, an empty completion included."""
  make = grpo._Group  # pylint: disable=protected-access
  logprobs = [[-0.5, -0.25], [-1.0], [], [-0.1, -0.2, -0.3]]
  logprobs = [np.array(row, np.float32) for row in logprobs]  # as the sampler returns them
  sampled = [np.array(row, np.int8) for row in ([1, 0], [1])]  # a tool's answer (rl.tools) in the first completion
  groups = [
      make(7, [1, 5, 9], [[3, 4], [6]], logprobs[:2], np.array([1.0, 0.0]), np.array([1.0, 2.0]), sampled),
      make(2, [1], [[], [8, 8, 8]], logprobs[2:], np.array([0.5, 0.5]), np.array([0.0, 0.5])),  # sampled: all
  ]
  # The reference's log-probs (rl.reference_devices=sampler) travel when asked for.
  groups[0].reference = [np.float32([-0.75, -2.0]), np.float32([-0.5])]
  groups[1].reference = [np.float32([]), np.float32([-1.5, -0.5, -0.25])]
  pack, unpack = grpo._pack, grpo._unpack  # pylint: disable=protected-access
  without = pack(groups, 3, group_size=2, prompt_width=4, new_tokens=3)
  assert "reference" not in without and unpack({key: value[0] for key, value in without.items()}).reference is None
  packed = pack(groups, 3, group_size=2, prompt_width=4, new_tokens=3, reference=True)
  assert {value.shape[0] for value in packed.values()} == {3}
  for i, group in enumerate(groups):
    got = unpack({key: value[i] for key, value in packed.items()})
    assert (got.index, got.prompt, got.completions) == (group.index, group.prompt, group.completions)
    for got_row, want_row in zip(got.logprobs, group.logprobs, strict=True):
      np.testing.assert_array_equal(got_row, want_row)
    np.testing.assert_array_equal(got.rewards, group.rewards)
    np.testing.assert_array_equal(got.filter_scores, group.filter_scores)
    for got_row, completion, want_row in zip(got.sampled, group.completions, group.sampled or [None] * 2, strict=True):
      np.testing.assert_array_equal(got_row, np.ones(len(completion)) if want_row is None else want_row)
    for got_row, want_row in zip(got.reference, group.reference, strict=True):
      np.testing.assert_array_equal(got_row, want_row)


@pytest.mark.parametrize(
    "metric, kept", [("shaped_reward", False), ("reward", True), ("correctness", False), ("format", True)]
)
def test_dynamic_sampling_compares_the_score_its_metric_names(make_config, metric, kept):
  """rl.dynamic_sampling_metric: the advantages' reward (default), the reward sum before the overlong penalty, or one
  reward of rl.rewards (DAPO's accuracy filter: correctness). Here both samples are correct, the second well formatted
  but penalised for its length: correctness and the shaped reward agree (group dropped), format and the sum do not."""
  objective = grpo.GRPO(
      make_config("posttrain_mode=dapo", "rl.num_generations=2", f"rl.dynamic_sampling_metric={metric}", config_file=GRPO)
  )
  correctness, formatted, penalty = np.array([1.0, 1.0]), np.array([0.0, 1.0]), np.array([0.0, -1.0])
  out = rl_base.Rollouts(
      indices=[3],
      prompts=[[1, 5]] * 2,
      completions=[[6], [7]],
      logprobs=[np.zeros(1)] * 2,
      lengths=np.array([1, 1]),
      rewards=correctness + formatted + penalty,
      scores={"correctness": correctness, "format": formatted, "reward": correctness + formatted},
  )
  [group] = objective._groups(out)  # pylint: disable=protected-access
  assert group.informative == kept


def test_sampler_and_trainer_score_every_sampled_token_alike(make_config):
  """The old log-probs the sampler records (decode path, KV cache, temperature 0.7) are the trainer's log-probs of
  the same tokens (one forward over prompt + completion), token by token: the first iteration's ratio is 1."""
  config = make_config(*TINY, *CHARACTERS, "decode_sampling_temperature=0.7", "eval_interval=0", config_file=GRPO)
  loop = trainer.setup(config)
  batch = loop.objective.before_step(loop, loop.train_batches.load_next_batch())
  with jax.set_mesh(loop.mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
    logps, _ = jax.jit(lambda state, b: rl_base.token_logps(nnx.merge(loop.primary.graphdef, state).model, b, 0.7))(
        loop.primary.state, batch
    )
  mask = np.asarray(batch["completion_mask"]) != 0
  difference = np.abs(np.asarray(logps) - np.asarray(batch["old_logps"]))[mask]
  assert mask.sum() >= 8 and difference.max() < 1e-4, difference.max()
  # The prompts a non-finite step's error would name (kept by step after it): those of the rollouts, one per prompt.
  prompts = loop.objective.trained_prompts()
  assert len(prompts) == config.global_batch_size_to_train_on and prompts[-1] < len(loop.objective.train_prompts)
  # The scores dynamic sampling may compare: each reward's by its name, and their weighted sum before shaping.
  out = loop.objective.sample(loop, loop.objective.indices(loop.train_batches.load_next_batch()), 0, None)
  assert sorted(out.scores) == sorted([*config.rl.rewards, config_lib.REWARD_SUM])
  np.testing.assert_array_equal(out.scores[config_lib.REWARD_SUM], out.rewards)  # no overlong penalty here
  assert np.ptp(out.rewards) > 0
  # rl.force_on_policy_ratio=true pins the ratio to 1 whatever old log-probs the batch carries.
  forced = config_lib.with_overrides(config, rl=config.rl.model_copy(update={"force_on_policy_ratio": True}))
  stale = batch | {"old_logps": batch["old_logps"] - 1.0}
  for objective, expected_ratio in ((loop.objective, np.e), (grpo.GRPO(forced), 1.0)):
    with jax.set_mesh(loop.mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
      out = jax.jit(lambda state, b, o=objective: o.loss(nnx.merge(loop.primary.graphdef, state).model, b, False))(
          loop.primary.state, stale
      )
    np.testing.assert_allclose(float(out.metrics["ratio_mean"] / out.weight), expected_ratio, rtol=1e-4)


def test_the_losses_read_the_lm_head_at_the_completions_only(make_config):
  """The policy's loss and the reference compute logits at each row's completion window only
  (`rl_base.completion_index`; here 16 of 80 positions): there they are the full forward's, also through LoRA
  adapters (qwix intercepts the windowed call as it does MaxText's), and the compiled GRPO train step costs fewer FLOPs
  than MaxText's own pretraining step on the same rows, which computes the logits everywhere."""
  from benchmarks import grpo_vs_pretrain, harness  # pylint: disable=import-outside-toplevel

  config = make_config(*TINY, *CHARACTERS, "rl.grpo_beta=0.04", "eval_interval=0", config_file=GRPO)
  loop = trainer.setup(config)
  batch = loop.objective.before_step(loop, loop.train_batches.load_next_batch())
  index = rl_base.completion_index(batch, config_lib.max_new_tokens(config))
  assert index.shape == (8, 16)
  rows = config.global_batch_size_to_train_on * config.rl.num_generations
  pretrain_config = config_lib.with_overrides(
      config, micro_batch_size_to_train_on=rows, global_batch_size_to_train_on=rows
  )
  with loop.primary.scope():
    train = loop.primary.p_train_step.lower(loop.primary.state, batch, {}).compile().cost_analysis()["flops"]
    pretraining_batch = grpo_vs_pretrain.pretraining_batch(batch)
    step = harness.jit_pretraining_step(loop, pretrain_config)
    pretrain = step.lower(loop.primary.state, pretraining_batch).compile().cost_analysis()["flops"]
  print(f"GFLOP: GRPO train step {train / 1e9:.3f}, MaxText's pretraining step {pretrain / 1e9:.3f}")
  assert train < 0.95 * pretrain, (train, pretrain)

  lora_config = make_config(
      *TINY,
      *CHARACTERS,
      "lora.enable_lora=true",
      "lora.lora_rank=4",
      "lora.lora_alpha=8",
      "eval_interval=0",
      config_file=GRPO,
  )
  lora_loop = trainer.setup(lora_config)
  model = lora_loop.policy()
  adapters = nnx.state(model, nnx.LoRAParam)
  keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(adapters))))
  nnx.update(model, jax.tree.map(lambda a: 0.1 * jax.random.normal(next(keys), a.shape, a.dtype), adapters))
  for policy in (loop.policy(), model):
    with loop.primary.scope():
      full = rl_base.token_logps(policy, batch, 0.7)
      window = rl_base.token_logps(policy, batch, 0.7, logit_index=index)
    np.testing.assert_allclose(window[0], rl_base.at_index(full[0], index), atol=1e-5)
    np.testing.assert_allclose(window[1], jnp.take_along_axis(full[1], index[..., None], axis=1), atol=1e-4)
  nnx.update(model, jax.tree.map(jnp.zeros_like, adapters))
  with loop.primary.scope():
    without_adapters = rl_base.token_logps(model, batch, 0.7, logit_index=index)[0]
  assert np.abs(np.asarray(window[0] - without_adapters)).max() > 1e-3  # the adapters did change the window's logits


@pytest.mark.parametrize("use_rollout_logps", [True, False])
def test_first_iteration_ratio_is_one_and_inner_iterations_reuse_the_rollouts(make_config, tmp_path, use_rollout_logps):
  """Old log-probs from the sampler, or recomputed by the trainer (MaxText's rl.use_rollout_logps=false), give ratio 1
  at the first iteration on a batch; with num_iterations=2 the second step trains on the same rollouts (ratio moves
  off 1) and draws no prompts."""
  metrics_file = tmp_path / "metrics.jsonl"
  config = make_config(
      *TINY, *CHARACTERS, "rl.num_iterations=2", "rl.grpo_beta=0.1", "learning_rate=1e-2", "steps=4", "eval_interval=0",
      f"rl.use_rollout_logps={str(use_rollout_logps).lower()}", f"metrics_file={metrics_file}", config_file=GRPO,
  )  # fmt: skip
  loop = trainer.setup(config)
  iterator_reads = []
  load = loop.train_batches.load_next_batch
  loop.train_batches.load_next_batch = lambda: iterator_reads.append(loop.step) or load()
  trainer.train(loop)
  rows = _metrics(metrics_file)
  assert iterator_reads == [0, 2]
  for step in (0, 2):
    assert rows[step]["rl/iteration"] == 0
    assert abs(rows[step]["learning/ratio_mean"] - 1.0) < 1e-5, rows[step]
  for step in (1, 3):
    assert rows[step]["rl/iteration"] == 1
    assert abs(rows[step]["learning/ratio_mean"] - 1.0) > 1e-4, rows[step]
  assert rows[0]["learning/kl"] < 1e-8 < rows[1]["learning/kl"]  # the policy starts as its reference, then leaves it
  assert rows[0]["rl/reward_std"] > 0 and rows[0]["learning/entropy"] > 1.0


def _reward_run(make_config, tmp_path, *overrides) -> tuple[list[float], dict[int, dict]]:
  """The mean rollout reward of each step of a seeded 30-step run from random weights."""
  metrics_file = tmp_path / "metrics.jsonl"
  config = make_config(
      *TINY, "per_device_batch_size=4", "learning_rate=1e-2", "steps=30", "eval_interval=0",
      f"metrics_file={metrics_file}", run_utils.WHOLE_TRAIN_SPLIT, *overrides, config_file=GRPO,
  )  # fmt: skip
  run_utils.run(config)
  rows = _metrics(metrics_file)
  return [rows[step]["rl/reward_mean"] for step in sorted(rows)], rows


def test_the_loop_keeps_the_first_and_the_latest_evaluation_only(make_config):
  """Evaluations every step: each logs its metrics, and the loop keeps the samples of the first and the latest only
  (the demo's paired before/after comparison), not one set per evaluation."""
  config = make_config(*TINY, *CHARACTERS, "steps=3", "eval_interval=1", "eval_generation_examples=2", config_file=GRPO)
  loop, summary = run_utils.run(config)
  assert sorted(summary["evals"]) == [0, 1, 2, 3], summary["evals"]
  assert sorted(loop.cache["evaluations"]) == [0, 3]
  assert loop.cache["evaluations"][3] is loop.cache["generations"]


@pytest.mark.parametrize("mode, overrides", [("grpo", ()), ("gspo_token", ()), ("grpo", AHEAD)])
def test_rl_raises_a_learnable_reward(make_config, tmp_path, mode, overrides):
  """Also with rollouts sampled one update ahead (rl.off_policy_steps=1): the ratio corrects for the lag."""
  rewards, rows = _reward_run(make_config, tmp_path, f"posttrain_mode={mode}", *CHARACTERS, *overrides)
  assert np.mean(rewards[-5:]) > np.mean(rewards[:5]) + 0.3, (mode, overrides, rewards)
  assert {rows[step]["rl/staleness"] for step in rows} == ({0.0, 1.0} if overrides else {0.0})


def test_dapo_refills_agreeing_groups_and_raises_the_reward(make_config, tmp_path):
  """Under random weights most groups agree (no digit anywhere, and every completion runs into the overlong
  penalty): dynamic sampling resamples, and the reward (digits, minus the overlong penalty) rises."""
  reward = ('rl.rewards=["tests.rewards_for_tests:contains_digit"]', "rl.reward_weights=[1.0]")
  rewards, rows = _reward_run(make_config, tmp_path, "posttrain_mode=dapo", *reward)
  assert rows[0]["rl/overlong_penalty"] < -0.5 and rows[0]["rl/zero_variance_fraction"] > 0
  assert max(row["rl/sampling_rounds"] for row in rows.values()) == 3  # rl.max_sampling_rounds
  assert np.mean(rewards[-5:]) > np.mean(rewards[:5]) + 0.5, rewards


def test_resume_samples_and_trains_as_the_uninterrupted_run(make_config, tmp_path):
  """A resumed RL run draws the same prompts (grain iterator checkpoint) and the same samples (the sampling key is
  folded from the step), so its rewards and losses are those of one uninterrupted run. With rl.num_iterations=2 the
  step-2 checkpoint falls part-way through the batch drawn at step 2: its rows are saved with it, and the resumed
  step 3 trains on them as the uninterrupted one did (a fresh draw would log a reward there). A non-finite step 3
  names that batch's prompts, restored with the rows, although its error comes a step later, after step 4 has drawn
  the next batch."""
  common = (*TINY, *CHARACTERS, "enable_checkpointing=true", "checkpoint_period=2", "eval_interval=0")
  common += ("async_checkpointing=false", "learning_rate_schedule_steps=5", "learning_rate=1e-2", "rl.num_iterations=2")

  def run(name, *overrides, poisoned_step=None):
    metrics_file = tmp_path / f"{name}.jsonl"
    loop = trainer.setup(
        make_config(*common, *overrides, f"metrics_file={metrics_file}", run_name=name, config_file=GRPO)
    )
    if poisoned_step is not None:  # NaN advantages make that step's loss and gradient non-finite
      before_step = loop.objective.before_step
      poison = lambda batch: batch | {"advantages": batch["advantages"] * jnp.nan}
      loop.objective.before_step = lambda l, b: (lambda out: poison(out) if l.step == poisoned_step else out)(
          before_step(l, b)
      )
    trainer.train(loop)
    return _metrics(metrics_file), loop.objective

  full, full_objective = run("full", "steps=5")
  trained = {step: full_objective.step_examples(step, None) for step in (3, 4)}  # kept for the steps not yet checked
  assert trained[3] and trained[4] and trained[3] != trained[4]  # step 4 draws a new batch
  run("split", "steps=3", "save_checkpoint_on_completion=false")  # dies after step 2; its last checkpoint is step 2's
  assert (tmp_path / "split" / "objective_state" / "2.rows.0.npz").exists()
  with pytest.raises(trainer.NonFiniteStep, match=r"^Step 3: non-finite") as error:
    run("split", "steps=5", poisoned_step=3)
  assert f"trained on prompts [{', '.join(map(str, trained[3]))}] of the train split" in str(error.value)
  split, _ = run("split", "steps=5")
  assert sorted(split) == sorted(full) == list(range(5))
  assert [split[s]["rl/iteration"] for s in range(5)] == [full[s]["rl/iteration"] for s in range(5)] == [0, 1, 0, 1, 0]
  for key in ("rl/reward_mean", "rl/completion_length_mean"):  # logged by the steps that draw a batch
    assert [s for s in range(5) if key in split[s]] == [s for s in range(5) if key in full[s]] == [0, 2, 4], key
    np.testing.assert_allclose([split[s][key] for s in (0, 2, 4)], [full[s][key] for s in (0, 2, 4)], rtol=1e-5)
  for key in ("learning/loss", "learning/grad_norm"):
    np.testing.assert_allclose([split[s][key] for s in range(5)], [full[s][key] for s in range(5)], rtol=1e-5)


def test_sampling_ahead_lags_one_update_keeps_the_data_order_and_resumes_exactly(make_config, tmp_path):
  """rl.off_policy_steps=1: each step trains on rollouts the previous weights sampled (ratio off 1 at the first
  iteration, `rl/staleness` 1), except after a checkpoint, where nothing was sampled ahead (staleness 0, ratio 1);
  the prompt batches come from the iterator in the same order as without sampling ahead, and a run resumed from a
  checkpoint repeats the uninterrupted run's metrics."""
  common = (*TINY, *CHARACTERS, *AHEAD, "enable_checkpointing=true", "checkpoint_period=3", "eval_interval=0")
  common += ("async_checkpointing=false", "learning_rate_schedule_steps=6", "learning_rate=1e-2")

  def run(name, *overrides, reads=None):
    metrics_file = tmp_path / f"{name}.jsonl"
    loop = trainer.setup(
        make_config(*common, *overrides, f"metrics_file={metrics_file}", run_name=name, config_file=GRPO)
    )
    load = loop.train_batches.load_next_batch
    if reads is not None:
      loop.train_batches.load_next_batch = lambda: (lambda b: reads.append((loop.step, loop.objective.indices(b))) or b)(
          load()
      )
    trainer.train(loop)
    return _metrics(metrics_file)

  ahead_reads, on_policy_reads = [], []
  full = run("full", "steps=6", reads=ahead_reads)
  run("on_policy", "steps=6", "rl.off_policy_steps=0", reads=on_policy_reads)
  # Saved after steps 0 and 3 (MaxText's save_checkpoint_on_start): steps 1 and 4 sample their own rollouts.
  assert [full[s]["rl/staleness"] for s in range(6)] == [0, 0, 1, 1, 0, 1]
  for step in range(6):
    assert (abs(full[step]["learning/ratio_mean"] - 1.0) < 1e-5) == (full[step]["rl/staleness"] == 0), full[step]
  assert [step for step, _ in ahead_reads] == [0, 1, 1, 2, 4, 4]  # steps 2, 3 and 5's prompts drawn a step early
  assert [indices for _, indices in ahead_reads] == [indices for _, indices in on_policy_reads]
  run("split", "steps=4", "save_checkpoint_on_completion=false")  # dies after step 3; its last checkpoint is step 3's
  split = run("split", "steps=6")
  for key in ("rl/reward_mean", "rl/staleness", "learning/loss", "learning/grad_norm", "learning/ratio_mean"):
    np.testing.assert_allclose([split[s][key] for s in range(6)], [full[s][key] for s in range(6)], rtol=1e-5)


def test_sampling_ahead_samples_dynamic_samplings_rounds_before_the_next_steps_rollouts(make_config):
  """With dynamic sampling a step dispatches the next step's rollouts after its own extra rounds, which would
  otherwise queue behind them on the sampler's devices: under rl.off_policy_steps=1 each step samples the prompts it
  samples without sampling ahead. A reward of 1.0 for every completion leaves every group uninformative, so every step
  samples rl.max_sampling_rounds rounds."""
  common = (*TINY, 'rl.rewards=["tests.rewards_for_tests:misbehaves"]', "rl.reward_weights=[1.0]", "steps=3")
  common += ("rl.dynamic_sampling=true", "rl.max_sampling_rounds=2", "eval_interval=0")
  sampled, staleness = {}, {}
  for name, overrides in (("ahead", AHEAD), ("on_policy", ())):
    loop = trainer.setup(make_config(*common, *overrides, run_name=name, config_file=GRPO))
    objective = loop.objective
    dispatch, after_step, rows = objective._dispatch, objective.after_step, sampled.setdefault(name, {})

    def record_dispatch(loop, indices, step, round_index, copy_params=False, dispatch=dispatch, rows=rows):
      rows[step, round_index] = list(indices)  # the prompts each round of each step samples, whenever dispatched
      return dispatch(loop, indices, step, round_index, copy_params)

    def record_step(loop, step, metrics, after_step=after_step, name=name):
      staleness.setdefault(name, []).append(loop.objective.step_metrics["rl/staleness"])
      after_step(loop, step, metrics)

    objective._dispatch, objective.after_step = record_dispatch, record_step  # pylint: disable=protected-access
    trainer.train(loop)
  assert staleness["ahead"] == [0, 1, 1]
  assert sampled["ahead"] == sampled["on_policy"]
  assert sorted(sampled["on_policy"]) == [(step, r) for step in range(3) for r in range(2)]  # 2 rounds per step


@pytest.mark.parametrize(
    "fractions, message",
    [
        (
            ("trainer_devices_fraction=0.5", "sampler_devices_fraction=0.5"),
            "1 devices leave the trainer 0 and the sampler 0",
        ),
        (("trainer_devices_fraction=1", "sampler_devices_fraction=0.5"), "would share some devices"),
    ],
)
def test_device_fractions_that_cannot_split_the_devices_are_refused(make_config, fractions, message):
  """MaxText's default halves of the one test device leave neither side a device; overlapping fractions are refused."""
  config = make_config("rl.off_policy_steps=1", *fractions, config_file=GRPO)
  with pytest.raises(ValueError, match=message):
    mesh_lib.trainer_and_rollout_meshes(config, separate=True)
  trainer_mesh, rollout_mesh = mesh_lib.trainer_and_rollout_meshes(config, separate=False)  # on-policy: one mesh
  assert trainer_mesh is rollout_mesh


def test_sampling_ahead_with_a_checkpoint_every_step_is_the_on_policy_run(make_config, tmp_path):
  """With a checkpoint after every step nothing is sampled ahead: rl.off_policy_steps=1 then runs exactly what
  rl.off_policy_steps=0 runs, bit for bit (the same keys, prompts and weights)."""
  common = (*TINY, *CHARACTERS, "enable_checkpointing=true", "checkpoint_period=1", "async_checkpointing=false")
  common += ("steps=3", "eval_interval=0", "learning_rate=1e-2")
  rows = {}
  for name, overrides in (("ahead", AHEAD), ("on_policy", ())):
    metrics_file = tmp_path / f"{name}.jsonl"
    run_utils.run(make_config(*common, *overrides, f"metrics_file={metrics_file}", run_name=name, config_file=GRPO))
    rows[name] = _metrics(metrics_file)
  for step in range(3):
    assert rows["ahead"][step]["rl/staleness"] == 0
    for key in ("rl/reward_mean", "rl/completion_length_mean", "learning/loss", "learning/grad_norm", "learning/kl"):
      assert rows["ahead"][step][key] == rows["on_policy"][step][key], (step, key)


# Dynamic sampling's second round on a reward whose even-length prompts' groups always agree: the batch then trains
# groups of both rounds.
ODD_PROMPTS_TWO_ROUNDS = (
    'rl.rewards=["tests.rewards_for_tests:characters_of_odd_prompts"]', "rl.reward_weights=[1.0]",
    "rl.dynamic_sampling=true", "rl.max_sampling_rounds=2",
)  # fmt: skip


# Two rounds take more steps to reach one whose batch mixes them.
@pytest.mark.parametrize(
    "rewards, steps", [(CHARACTERS, 2), (ODD_PROMPTS_TWO_ROUNDS, 4)], ids=["one_round", "two_rounds"]
)
def test_the_reference_on_the_samplers_devices_scores_as_the_trainers_reference(make_config, tmp_path, rewards, steps):
  """rl.reference_devices=sampler: the reference scores each rollout batch right after its decode program, from the
  program's arrays (on the one test device, shared here), and the steps' KL and losses are bit for bit those of the
  reference scoring the training rows before the step; with dynamic sampling, a batch's groups from each round carry
  their own round's reference log-probs."""
  common = (*TINY, *rewards, *AHEAD, "rl.grpo_beta=0.1", f"steps={steps}", "eval_interval=0", "learning_rate=1e-2")
  rows = {}
  for devices in ("trainer", "sampler"):
    metrics_file = tmp_path / f"{devices}.jsonl"
    overrides = (f"rl.reference_devices={devices}", f"metrics_file={metrics_file}")
    run_utils.run(make_config(*common, *overrides, run_name=devices, config_file=GRPO))
    rows[devices] = _metrics(metrics_file)
  assert rows["sampler"][1]["learning/kl"] > 0  # the policy has moved off the reference
  for step in range(steps):
    for key in ("rl/reward_mean", "learning/kl", "learning/loss", "learning/grad_norm"):
      assert rows["sampler"][step][key] == rows["trainer"][step][key], (step, key)
  assert rows["trainer"][1]["rl/reference_seconds"] > 0 and rows["sampler"][1]["rl/reference_seconds"] >= 0
  if rewards == ODD_PROMPTS_TWO_ROUNDS:  # a step whose batch, full of informative groups, took some from round 1
    mixed = [row["rl/sampling_rounds"] == 2 and row["rl/masked_groups"] == 0 for row in rows["sampler"].values()]
    assert any(mixed), rows["sampler"]


def test_sampling_ahead_with_several_steps_per_batch_samples_the_next_batch_during_the_last_step(make_config, tmp_path):
  """rl.off_policy_steps=1 with rl.num_iterations=2: the batch of step 2 is dispatched by step 1 (the last step on
  step 0's batch), so step 2 trains on rollouts one update old; a run resumed from the step-2 checkpoint, part-way
  through that batch, trains step 3 on its saved rows and samples step 4's batch ahead as the uninterrupted run did.
  With the reference on the sampler's devices the resumed step 3 has no reference to run: its KL term reads the
  reference column of the saved rows (zeroing that column on restore changes the losses)."""
  common = (*TINY, *CHARACTERS, *AHEAD, "rl.num_iterations=2", "eval_interval=0", "enable_checkpointing=true")
  common += ("rl.grpo_beta=0.1", "rl.reference_devices=sampler")
  common += ("checkpoint_period=2", "async_checkpointing=false", "learning_rate_schedule_steps=5", "learning_rate=1e-2")

  def run(name, *overrides):
    metrics_file = tmp_path / f"{name}.jsonl"
    run_utils.run(make_config(*common, *overrides, f"metrics_file={metrics_file}", run_name=name, config_file=GRPO))
    return _metrics(metrics_file)

  full = run("full", "steps=5")
  assert [full[s].get("rl/staleness") for s in range(5)] == [0.0, None, 1.0, None, 1.0]
  run("split", "steps=3", "save_checkpoint_on_completion=false")  # dies after step 2, part-way through its batch
  split = run("split", "steps=5")
  assert [split[s].get("rl/staleness") for s in range(5)] == [0.0, None, 1.0, None, 1.0]
  assert full[3]["learning/kl"] > 0
  for key in ("rl/reward_mean", "learning/loss", "learning/grad_norm", "learning/ratio_mean", "learning/kl"):
    steps = [s for s in range(5) if key in full[s]]
    np.testing.assert_allclose([split[s][key] for s in steps], [full[s][key] for s in steps], rtol=1e-5, err_msg=key)


def test_lora_is_a_switch_on_rl_too(make_config, tmp_path, sft_checkpoint):
  """GRPO with lora.enable_lora=true on the SFT model: rollouts sample the merged policy (merged by one program,
  compiled once for the 30 rollouts), the KL reference is the policy with its adapters off (no second copy), only
  adapters train, and the reward still rises. From the SFT model (sft_lora.yml's lr) the rise is steady: 0.167 ->
  +0.13, +0.15, +0.13 for rl.sampling_seed 0, 1, 2 when this was written (from random weights at lr 3e-2 it was
  +0.79, -0.02, +0.29: seed luck)."""
  config = make_config(
      *TINY, *CHARACTERS, "lora.enable_lora=true", "lora.lora_rank=8", "lora.lora_alpha=16", "rl.grpo_beta=0.01",
      "per_device_batch_size=4", "learning_rate=1e-2", "steps=30", "eval_interval=0",
      f"load_parameters_path={sft_checkpoint}", f"metrics_file={tmp_path / 'metrics.jsonl'}",
      run_utils.WHOLE_TRAIN_SPLIT, config_file=GRPO,
  )  # fmt: skip
  loop = trainer.setup(config)
  assert loop.frozen["reference"].follows_policy
  frozen = lambda: jax.device_get(nnx.state(loop.policy(), nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))).to_pure_dict())
  base = frozen()
  trainer.train(loop)
  jax.tree.map(np.testing.assert_array_equal, frozen(), base)
  assert loop._merge._cache_size() == 1  # pylint: disable=protected-access
  rows = _metrics(tmp_path / "metrics.jsonl")
  rewards = [rows[step]["rl/reward_mean"] for step in sorted(rows)]
  assert rows[0]["learning/kl"] < 1e-8 < rows[29]["learning/kl"]
  assert np.mean(rewards[-5:]) > np.mean(rewards[:5]) + 0.05, rewards


@pytest.mark.parametrize("estimator, warned", [("k1", True), ("k3", False)])
def test_a_k1_kl_term_in_the_loss_is_warned_of(make_config, caplog, estimator, warned):
  """k1 in the loss regularises nothing in expectation (its gradient is the score function); it runs, with a warning."""
  with caplog.at_level(logging.WARNING):
    grpo.GRPO(make_config("rl.grpo_beta=0.04", f"rl.kl_estimator={estimator}", config_file=GRPO))
  assert ("rl.kl_estimator=k1 in the loss" in caplog.text) == warned, caplog.text

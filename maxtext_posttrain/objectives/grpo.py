"""The GRPO family: critic-free RL from G sampled completions per prompt, scored by reward functions.

`posttrain_mode` is one of grpo, drgrpo, dapo, gspo, gspo_token, rloo: one objective whose `rl.*` keys
(`config.RL_PRESETS`) make the variant, so any mode can be adjusted key by key (`posttrain_mode=grpo
rl.loss_algo=gspo-token` is MaxText's way of asking for GSPO-token).

A step, on the host (`before_step`): the prompt iterator yields this step's prompt indices; the rollout sampler (MaxText
decoding with the KV cache, on the trainer's mesh, reading the policy's weights in place) draws G completions per
prompt with their log-probs; the rewards score them (plus DAPO's overlong shaping); group advantages follow; with
dynamic sampling, groups whose rewards all agree are replaced by fresh prompts' groups for up to
`rl.max_sampling_rounds` rounds; with `rl.grpo_beta` > 0 the frozen reference scores the batch. Rows are
prompt + completion, one per sample, with the sampler's log-probs as the old policy's. The jitted step then
differentiates the clipped surrogate (`losses.policy_gradient`). With `rl.num_iterations` = mu > 1 the same
rollout batch is trained on for mu steps (GRPO's inner iterations), the old log-probs fixed at sampling time.
"""

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from maxtext.utils import sharding as maxtext_sharding
from maxtext_posttrain import config as config_lib
from maxtext_posttrain import evaluate as evaluate_lib
from maxtext_posttrain import rewards as rewards_lib
from maxtext_posttrain import roles
from maxtext_posttrain import rollout
from maxtext_posttrain.data import pipeline
from maxtext_posttrain.data import prompts as prompts_lib
from maxtext_posttrain.losses import advantages as advantages_lib
from maxtext_posttrain.losses import logprobs as logprobs_lib
from maxtext_posttrain.losses import policy_gradient
from maxtext_posttrain.objectives.base import LossOutput, Objective, ObjectiveData, register
from maxtext_posttrain.peft import lora
from maxtext_posttrain.rewards import shaping

ROW_KEYS = ("inputs", "targets", "positions", "segmentation", "completion_mask", "old_logps", "advantages")
REFERENCE_KEY = "reference_logps"
_ALGOS = {"grpo": "grpo", "gspo": "gspo", "gspo-token": "gspo_token"}


def training_rows(
    prompts: list[list[int]], completions: list[list[int]], logprobs: list[np.ndarray], length: int
) -> dict[str, np.ndarray]:
  """[N, length] rows of prompt + completion, next-token shifted, with the sampler's log-probs on the targets.

  Row i holds prompt_i + completion_i without its last token as inputs; `completion_mask` is 1 where the target is
  a completion token, and `old_logps` there is the sampler's log-prob of that token. Padding has segment id 0.
  """
  rows = {key: np.zeros((len(prompts), length), np.int32) for key in ROW_KEYS[:5]}
  rows["old_logps"] = np.zeros((len(prompts), length), np.float32)
  for i, (prompt, completion, logps) in enumerate(zip(prompts, completions, logprobs, strict=True)):
    sequence = list(prompt) + list(completion)
    if len(sequence) > length + 1:
      raise ValueError(f"Row {i}: {len(sequence)} tokens do not fit in {length} + 1.")
    n = len(sequence) - 1
    rows["inputs"][i, :n] = sequence[:-1]
    rows["targets"][i, :n] = sequence[1:]
    rows["positions"][i] = np.arange(length)
    rows["segmentation"][i, :n] = 1
    start = len(prompt) - 1
    rows["completion_mask"][i, start : start + len(completion)] = 1
    rows["old_logps"][i, start : start + len(completion)] = logps[: len(completion)]
  return rows


def token_logps(
    model,
    batch: dict[str, jax.Array],
    temperature: jax.Array,
    num_pieces: int | None = None,
    enable_dropout: bool = False,
):
  """[N, L] log-probs of the targets under softmax(logits / T), and the [N, L, V] tempered logits.

  With `num_pieces` (the tokenizer's) the ids it cannot decode are masked out as the sampler masks them, so the
  scored distribution is the sampled one; None scores the whole vocabulary.
  """
  logits = model(
      decoder_input_tokens=batch["inputs"],
      decoder_positions=batch["positions"],
      decoder_segment_ids=batch["segmentation"],
      enable_dropout=enable_dropout,
  )
  logits = logits.astype(jnp.float32) / temperature
  if num_pieces is not None:
    logits = logprobs_lib.mask_undecodable(logits, num_pieces)
  return logprobs_lib.token_logprobs(logits, batch["targets"]), logits


@dataclasses.dataclass
class _Group:
  """One prompt's G samples, scored."""

  prompt: list[int]  # as the sampler saw it (left-truncated when longer than max_prefill_predict_length)
  completions: list[list[int]]
  logprobs: list[np.ndarray]
  rewards: np.ndarray  # [G], shaped: the weighted reward sum plus the overlong penalty

  @property
  def informative(self) -> bool:
    return bool(np.any(self.rewards != self.rewards[0]))


class GRPO(Objective):
  """`posttrain_mode=grpo` (and the presets registered below): group-relative policy optimisation."""

  name = "grpo"
  batch_keys = ROW_KEYS

  def headline_metrics(self, scalars: dict[str, Any]) -> dict[str, float]:
    """The rollouts' mean shaped reward (absent on the inner iterations of `rl.num_iterations`, which sample none),
    and the KL to the reference when the loss has a KL term."""
    names = {"reward": "rl/reward_mean"} | ({"kl": "learning/kl"} if self.rl.grpo_beta > 0 else {})
    return {name: float(scalars[key]) for name, key in names.items() if key in scalars}

  def __init__(self, config):
    super().__init__(config)
    self.rl = rl = config.rl
    self.rows_per_example = rl.num_generations
    if rl.grpo_beta > 0:
      self.roles = ("reference",)
      self.batch_keys = ROW_KEYS + (REFERENCE_KEY,)
    self.algo = _ALGOS[rl.loss_algo]
    self.agg_mode = config_lib.AGG_MODE_ALIASES[rl.loss_agg_mode]
    self.max_new_tokens = config.max_target_length - config.max_prefill_predict_length
    self.sampling = rollout.SamplingParams.from_config(config)
    self.rewards = rewards_lib.RewardSet(rl.rewards, rl.reward_weights or [1.0] * len(rl.rewards), rl.reward_on_error)
    self.encoder = pipeline.Encoder.from_config(config)
    self.num_pieces = self.encoder.num_pieces  # ids the sampler can draw; the loss scores the same distribution
    self.train_prompts = self.eval_prompts = None
    self._sampler = None
    self._old_policy = None  # the policy's forward under jit, for rl.use_rollout_logps=false
    self._batch = None  # the rollout batch of the current num_iterations cycle
    self.step_metrics = {}  # host-side metrics of the last step (rollout, rewards, timings), logged with its own

  def make_data(self, mesh) -> ObjectiveData:
    config = self.config
    self.train_prompts = prompts_lib.load(config, train=True, encoder=self.encoder)
    description = {"mode": self.name, "train": self.train_prompts.describe(), "rl": self.rl.model_dump()}
    if config.eval_interval > 0 and config.eval_generation_examples > 0:
      self.eval_prompts = prompts_lib.load(config, False, limit=config.eval_generation_examples, encoder=self.encoder)
      description["eval"] = self.eval_prompts.describe()
    iterator = prompts_lib.make_prompt_iterator(config, mesh, self.train_prompts)
    return ObjectiveData(train=iterator, eval=None, description=description)

  def sampler(self, loop) -> rollout.Sampler:
    if self._sampler is None:
      self._sampler = rollout.Sampler(self.config, loop.mesh)
    return self._sampler

  def wants_batch(self, loop) -> bool:
    return self._batch is None or loop.step % self.rl.num_iterations == 0

  def before_step(self, loop, batch):
    if batch is None:  # another iteration on the cycle's rollouts; the old log-probs stay those of sampling time
      self.step_metrics = {"rl/iteration": float(loop.step % self.rl.num_iterations)}
      return self._batch
    timer, metrics = time.perf_counter(), {"rl/iteration": 0.0}
    groups, first_round, rounds = [], None, 0
    indices = self._indices(batch)
    num_prompts = len(indices)
    while True:
      sampled = self._sample_groups(loop, indices, rounds, metrics)
      rounds += 1
      first_round = first_round or sampled
      groups += sampled
      informative = sum(g.informative for g in groups)
      if not self.rl.dynamic_sampling or informative >= num_prompts or rounds == self.rl.max_sampling_rounds:
        break
      indices = self._indices(loop.train_batches.load_next_batch())
    groups, masked = self._select(groups, num_prompts)
    rewards = np.concatenate([g.rewards for g in first_round])
    metrics |= {
        "rl/reward_mean": float(rewards.mean()),
        "rl/reward_std": float(rewards.std()),
        "rl/zero_variance_fraction": float(np.mean([not g.informative for g in first_round])),
        "rl/sampling_rounds": float(rounds),
        "rl/masked_groups": float(masked),
        "rl/reward_errors": float(sum(self.rewards.errors.values())),
    }
    batch = self._device_batch(loop, groups, masked)
    temperature = jnp.float32(self.sampling.temperature)
    if not self.rl.use_rollout_logps:  # MaxText's re-forward path: the trainer scores the rollouts before the step
      self._old_policy = self._old_policy or roles.FrozenModel(self.config, loop.mesh, None, None)
      self._old_policy.graphdef, self._old_policy.state = nnx.split(loop.policy())
      batch["old_logps"] = self._old_policy.run(self._target_logps, batch, temperature)
    if self.rl.grpo_beta > 0:
      start = time.perf_counter()
      batch[REFERENCE_KEY] = jax.block_until_ready(loop.role("reference").run(self._target_logps, batch, temperature))
      metrics["rl/reference_seconds"] = time.perf_counter() - start
    metrics["rl/before_step_seconds"] = time.perf_counter() - timer
    self._batch = batch
    self.step_metrics = metrics
    return self._batch

  def _target_logps(self, model, batch: dict[str, jax.Array], temperature: jax.Array) -> jax.Array:
    """[N, L] log-probs of the targets under a frozen model: the reference's, or the old policy's when recomputed."""
    return token_logps(model, batch, temperature, self.num_pieces)[0]

  def _indices(self, batch) -> list[int]:
    """This step's prompt indices (every process gets the whole global batch)."""
    return [int(i) for i in np.asarray(multihost_utils.process_allgather(batch[prompts_lib.INDEX_KEY], tiled=True))[:, 0]]

  def _sample_groups(self, loop, indices: list[int], round_index: int, metrics: dict) -> list[_Group]:
    """G completions for each prompt, scored; adds rollout statistics of the first round to `metrics`."""
    config, rl, prompt_set = self.config, self.rl, self.train_prompts
    group_size = rl.num_generations
    rng = jax.random.fold_in(jax.random.fold_in(jax.random.key(rl.sampling_seed), loop.step), round_index)
    start = time.perf_counter()
    out = self.sampler(loop).sample(
        lora.policy_params(loop.policy(), config),
        [list(prompt_set.prompt_ids[i]) for i in indices],
        self.max_new_tokens,
        self.encoder.tokenizer.eos_id,
        rng,
        self.sampling,
        num_samples=group_size,
    )
    rollout_seconds = time.perf_counter() - start
    completions = out.completions()
    texts = [self.encoder.decode_completion(c) for c in completions]
    start = time.perf_counter()
    rows = [i for i in indices for _ in range(group_size)]
    total, per_function = self.rewards.score(
        [prompt_set.prompt_texts[i] for i in rows], texts, [prompt_set.answers[i] for i in rows]
    )
    penalty = shaping.overlong_penalty(out.lengths, self.max_new_tokens, rl.overlong_buffer_length, rl.overlong_penalty)
    shaped = total + penalty
    if round_index == 0:
      metrics |= {f"rl/rewards/{name}": float(np.mean(scores)) for name, scores in per_function.items()}
      metrics |= {f"rl/rewards/{name}_std": float(np.std(scores)) for name, scores in per_function.items()}
      metrics |= {
          "rl/rollout_seconds": rollout_seconds,
          "rl/reward_seconds": time.perf_counter() - start,
          "rl/overlong_penalty": float(penalty.mean()),
          "rl/completion_length_mean": float(np.mean(out.lengths)),
          "rl/completion_length_max": float(np.max(out.lengths)),
          "rl/truncated_fraction": float(np.mean([r == "length" for r in out.finish_reasons])),
      }
    return [
        _Group(
            prompt=out.prompts[p * group_size],
            completions=completions[p * group_size : (p + 1) * group_size],
            logprobs=[out.logprobs[r] for r in range(p * group_size, (p + 1) * group_size)],
            rewards=shaped[p * group_size : (p + 1) * group_size],
        )
        for p in range(len(indices))
    ]

  def _select(self, groups: list[_Group], num_prompts: int) -> tuple[list[_Group], int]:
    """The batch's `num_prompts` groups and how many are masked out. Without dynamic sampling: all of them. With
    it: informative groups first, in sampling order; slots left over after the last round take uninformative
    groups with their loss masked out, so the batch keeps its shape and only informative groups train."""
    if not self.rl.dynamic_sampling:
      return groups, 0
    informative = [g for g in groups if g.informative][:num_prompts]
    filler = [g for g in groups if not g.informative][: num_prompts - len(informative)]
    return informative + filler, len(filler)

  def _device_batch(self, loop, groups: list[_Group], masked: int) -> dict[str, jax.Array]:
    """The groups' training rows with their advantages, placed on the input sharding."""
    config, rl = self.config, self.rl
    rewards = np.concatenate([g.rewards for g in groups])
    advantages = np.asarray(
        advantages_lib.group_advantages(
            rewards, rl.num_generations, estimator=rl.advantage_estimator, scale_by_std=rl.scale_rewards
        )
    )
    rows = training_rows(
        [g.prompt for g in groups for _ in g.completions],
        [c for g in groups for c in g.completions],
        [lp for g in groups for lp in g.logprobs],
        config.max_target_length,
    )
    if masked:
      rows["completion_mask"][-masked * rl.num_generations :] = 0
    rows["advantages"] = np.repeat(advantages[:, None].astype(np.float32), config.max_target_length, axis=1)
    sharding = maxtext_sharding.get_input_data_sharding(config, loop.mesh)
    return {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx]) for k, v in rows.items()}

  def after_step(self, loop, step, metrics):
    metrics["scalar"].update(self.step_metrics)

  def loss(self, model, batch: dict[str, jax.Array], is_train: bool) -> LossOutput:
    config, rl = self.config, self.rl
    logps, logits = token_logps(
        model, batch, self.sampling.temperature, self.num_pieces, enable_dropout=config.enable_dropout and is_train
    )
    mask = batch["completion_mask"]
    old_logps = jax.lax.stop_gradient(logps) if rl.force_on_policy_ratio else batch["old_logps"]
    advantages = batch["advantages"][:, 0] if self.algo == "gspo" else batch["advantages"]
    out = policy_gradient.policy_loss(
        logps,
        old_logps,
        advantages,
        mask,
        algo=self.algo,
        epsilon_low=rl.grpo_epsilon,
        epsilon_high=rl.epsilon_high,
        dual_clip=rl.dual_clip,
        ref_logps=batch.get(REFERENCE_KEY),
        beta=rl.grpo_beta,
        kl_estimator=rl.kl_estimator,
        agg_mode=self.agg_mode,
        max_length=self.max_new_tokens,
    )
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
    mean_mode = "token-mean" if self.agg_mode == "token-mean" else "seq-mean-token-mean"
    metrics = out.metrics | {"entropy": policy_gradient.aggregate(entropy, mask, mean_mode)[0]}
    return LossOutput(out.total, out.weight, {k: jax.lax.stop_gradient(v) for k, v in metrics.items()})

  def evaluate(self, loop) -> dict[str, float]:
    if self.eval_prompts is None:
      return {}
    params = lora.policy_params(loop.policy(), self.config)
    metrics, samples = evaluate_lib.evaluate(self.sampler(loop), params, self.eval_prompts, self.config, self.encoder)
    loop.cache["generations"] = samples
    loop.cache.setdefault("evaluations", {})[loop.step] = samples  # with per-prompt scores, for paired comparisons
    return {f"eval/{name}": value for name, value in metrics.items()}


def _preset(mode: str) -> type[GRPO]:
  return register(type(mode, (GRPO,), {"name": mode, "__doc__": f"`posttrain_mode={mode}`: GRPO with its preset."}))


for _mode in config_lib.RL_PRESETS:
  if _mode != "grpo":
    _preset(_mode)
register(GRPO)

"""What the RL objectives share: prompts, rollouts sampled by the run's sampler, their rewards, and pass@k evaluation.

GRPO and PPO both sample completions of training prompts with MaxText decoding (the run's one `rollout.Sampler`,
reading the policy's weights in place), score them with the reward functions of `rl.rewards` (plus DAPO's overlong
shaping) and, when `rl.rewards` names `reward_model`, with a frozen reward model (a `posttrain_mode=reward_model`
run's checkpoint, `reward_model_overrides.load_parameters_path`) run on the rollout rows. They differ in what they
make of the scores: group-relative advantages (GRPO) or a learned critic's GAE (PPO).
"""

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from maxtext_posttrain import config as config_lib
from maxtext_posttrain import evaluate as evaluate_lib
from maxtext_posttrain import forward
from maxtext_posttrain import rewards as rewards_lib
from maxtext_posttrain import roles
from maxtext_posttrain import rollout
from maxtext_posttrain.data import pipeline
from maxtext_posttrain.data import preference as preference_data
from maxtext_posttrain.data import prompts as prompts_lib
from maxtext_posttrain.losses import distillation
from maxtext_posttrain.losses import policy_gradient
from maxtext_posttrain.objectives.base import Objective, ObjectiveData
from maxtext_posttrain.peft import lora
from maxtext_posttrain.rewards import shaping

ROW_KEYS = ("inputs", "targets", "positions", "segmentation", "completion_mask", "old_logps", "advantages")
ROW_FLOATS = ("old_logps", "advantages")  # float32 columns of the rows; the others are int32
REWARD_MODEL = "reward_model"  # the name of the reward model in rl.rewards, and its role


def training_rows(
    prompts: list[list[int]], completions: list[list[int]], logprobs: list[np.ndarray] | None, length: int
) -> dict[str, np.ndarray]:
  """[N, length] rows of prompt + completion, next-token shifted, with the sampler's log-probs on the targets.

  Row i holds prompt_i + completion_i without its last token as inputs; `completion_mask` is 1 where the target is
  a completion token, and `old_logps` there is the sampler's log-prob of that token (no `old_logps` without
  `logprobs`: completions nobody sampled). Padding has segment id 0.
  """
  rows = {key: np.zeros((len(prompts), length), np.int32) for key in ROW_KEYS[:5]}
  if logprobs is not None:
    if len(logprobs) != len(prompts):
      raise ValueError(f"{len(logprobs)} log-prob arrays for {len(prompts)} rows.")
    rows["old_logps"] = np.zeros((len(prompts), length), np.float32)
  for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
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
    if logprobs is not None:
      rows["old_logps"][i, start : start + len(completion)] = logprobs[i][: len(completion)]
  return rows


def token_logps(model, batch: dict[str, jax.Array], temperature: jax.Array, num_pieces=None, enable_dropout=False):
  """([N, L] log-probs of the rows' targets under softmax(logits / T), the [N, L, V] tempered logits)."""
  return forward.token_logps(
      model,
      batch["inputs"],
      batch["positions"],
      batch["segmentation"],
      batch["targets"],
      temperature,
      num_pieces,
      enable_dropout,
  )


def reward_model_role(config) -> roles.RoleSpec:
  """The frozen reward model: a scalar-head model of the run's config plus `reward_model_overrides`."""
  overrides = dict(config.reward_model_overrides)
  if not overrides.get("load_parameters_path"):
    raise ValueError(
        "rl.rewards names reward_model but reward_model_overrides.load_parameters_path is not set: point it at the "
        "checkpoint of a posttrain_mode=reward_model run (<run>/checkpoints/<step>/items)."
    )
  return roles.RoleSpec(
      REWARD_MODEL, trained=False, head="scalar", overrides_key="reward_model_overrides", overrides=overrides
  )


def check_config(config, min_generations: int) -> None:
  """Raises ValueError naming the key for rl.* settings an RL objective cannot honour."""
  rl = config.rl
  mode = f"posttrain_mode={config.posttrain_mode}"
  budget = config_lib.max_new_tokens(config)
  if budget < 1:
    raise ValueError(
        f"{mode} generates max_target_length - max_prefill_predict_length tokens per completion; "
        f"{config.max_target_length} - {config.max_prefill_predict_length} leaves none."
    )
  if rl.overlong_buffer_length >= budget:
    raise ValueError(
        f"rl.overlong_buffer_length={rl.overlong_buffer_length} must be below the generation budget "
        f"max_target_length - max_prefill_predict_length = {budget} tokens."
    )
  if rl.num_generations < min_generations:
    raise ValueError(
        f"rl.num_generations={rl.num_generations}: {mode} needs at least {min_generations} completions per prompt."
    )
  if config.packing:
    raise ValueError(f"{mode} trains on one row per completion; set packing=false.")
  if rl.reward_weights and len(rl.reward_weights) != len(rl.rewards):
    raise ValueError(f"rl.reward_weights {rl.reward_weights} needs one weight per reward of rl.rewards {rl.rewards}.")
  unsupported = {"use_agentic_rollout": rl.use_agentic_rollout, "off_policy_steps": rl.off_policy_steps}
  named = [key for key, on in unsupported.items() if on]
  if named:
    raise ValueError(
        f"{mode} does not support rl.{', rl.'.join(named)}: rollouts are sampled on the trainer's mesh right "
        "before each step, by the policy being trained."
    )
  if max(config.eval_pass_at_k) > config.eval_samples_per_prompt or min(config.eval_pass_at_k) < 1:
    raise ValueError(
        f"eval_pass_at_k={config.eval_pass_at_k} needs 1 <= k <= eval_samples_per_prompt={config.eval_samples_per_prompt}."
    )


def check_cycle(config, steps_per_rollout: int, what: str) -> None:
  """Raises ValueError unless checkpoints fall between rollout batches (every `steps_per_rollout` steps), so that a
  resumed run samples what the run it continues would have."""
  if steps_per_rollout > 1 and config.enable_checkpointing and config.checkpoint_period % steps_per_rollout:
    raise ValueError(
        f"checkpoint_period={config.checkpoint_period} must be a multiple of {what}, so that every checkpoint "
        "falls between rollout batches and a resumed run samples what the run it continues would have."
    )


def gathered(values: np.ndarray) -> np.ndarray:
  """Every process's `values` (rows of its part of the batch), concatenated in process order: the whole batch's
  rows, for statistics and decisions all processes must share."""
  return np.asarray(multihost_utils.process_allgather(np.asarray(values), tiled=True))


@dataclasses.dataclass
class Rollouts:
  """Sampled completions of this process's prompts, scored; row r is sample r % n of prompt r // n."""

  prompts: list[list[int]]  # per row, as the sampler saw it (left-truncated when longer than the prefill length)
  completions: list[list[int]]
  logprobs: list[np.ndarray]
  lengths: np.ndarray
  rewards: np.ndarray  # [rows], shaped: the weighted reward sum plus the overlong penalty


class RLObjective(Objective):
  """Prompts, rollouts, rewards and evaluation of an RL objective; subclasses turn rollouts into training rows."""

  def __init__(self, config, min_generations: int):
    super().__init__(config)
    check_config(config, min_generations)
    self.rl = rl = config.rl
    self.rows_per_example = rl.num_generations
    self.max_new_tokens = config_lib.max_new_tokens(config)
    self.sampling = rollout.SamplingParams.from_config(config)
    weights = rl.reward_weights or [1.0] * len(rl.rewards)
    functions = [(name, weight) for name, weight in zip(rl.rewards, weights) if name != REWARD_MODEL]
    # The reward functions; None when the reward model is the only reward.
    self.rewards = None
    if functions or not rl.rewards:
      self.rewards = rewards_lib.RewardSet([n for n, _ in functions], [w for _, w in functions], rl.reward_on_error)
    self.reward_model_weight = dict(zip(rl.rewards, weights)).get(REWARD_MODEL)
    if self.reward_model_weight is not None:
      self.roles += (reward_model_role(config),)
    if rl.teacher_kl_coef > 0:
      self.roles += (roles.teacher(config, f"rl.teacher_kl_coef={rl.teacher_kl_coef}"),)
    self.encoder = pipeline.Encoder.from_config(config)
    self.num_pieces = self.encoder.num_pieces  # ids the sampler can draw; the loss scores the same distribution
    self.train_prompts = self.eval_prompts = None
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

  def reward_errors(self) -> float:
    """Failed reward-function rows so far, on all processes (scored 0 under rl.reward_on_error=zero)."""
    errors = float(sum(self.rewards.errors.values())) if self.rewards is not None else 0.0
    return float(gathered(np.array([errors], np.float32)).sum())

  def after_step(self, loop, step, metrics):
    metrics["scalar"].update(self.step_metrics)

  def indices(self, batch) -> list[int]:
    """This process's prompts of the step: the indices in its block of the batch's rows."""
    return [int(i) for i in pipeline.local_rows(batch[prompts_lib.INDEX_KEY])[:, 0]]

  def sample(self, loop, indices: list[int], round_index: int, metrics: dict | None) -> Rollouts:
    """`rl.num_generations` completions for each of this process's prompts, sampled (`process_local`) and scored
    here, each row once, on the process that owns it; adds the whole batch's rollout statistics to `metrics` (if
    given)."""
    rl, prompt_set = self.rl, self.train_prompts
    num_samples = rl.num_generations
    rng = jax.random.fold_in(jax.random.fold_in(jax.random.key(rl.sampling_seed), loop.step), round_index)
    start = time.perf_counter()
    out = loop.sampler().sample(
        lora.policy_params(loop.policy(), self.config),
        [list(prompt_set.prompt_ids[i]) for i in indices],
        self.max_new_tokens,
        self.encoder.tokenizer.eos_id,
        rng,
        self.sampling,
        num_samples=num_samples,
        process_local=True,
    )
    rollout_seconds = time.perf_counter() - start
    completions = out.completions()
    texts = [self.encoder.decode_completion(c) for c in completions]
    start = time.perf_counter()
    rows = [i for i in indices for _ in range(num_samples)]
    total, per_function = np.zeros(len(rows), np.float32), {}
    if self.rewards is not None:
      total, per_function = self.rewards.score(
          [prompt_set.prompt_texts[i] for i in rows], texts, [prompt_set.answers[i] for i in rows]
      )
    if self.reward_model_weight is not None:
      scores = self.reward_model_scores(loop, out.prompts, completions)
      total = total + np.float32(self.reward_model_weight) * scores
      per_function[REWARD_MODEL] = scores
    penalty = shaping.overlong_penalty(out.lengths, self.max_new_tokens, rl.overlong_buffer_length, rl.overlong_penalty)
    shaped = total + penalty
    if metrics is not None:
      reward_seconds = time.perf_counter() - start
      truncated = np.array([r == "length" for r in out.finish_reasons], np.float32)
      columns = gathered(np.stack([*per_function.values(), penalty, out.lengths, truncated], axis=1).astype(np.float32))
      for name, scores in zip(per_function, columns.T):
        metrics |= {f"rl/rewards/{name}": float(np.mean(scores)), f"rl/rewards/{name}_std": float(np.std(scores))}
      penalty, lengths, truncated = columns.T[-3:]
      metrics |= {
          "rl/rollout_seconds": rollout_seconds,
          "rl/reward_seconds": reward_seconds,
          "rl/overlong_penalty": float(penalty.mean()),
          "rl/completion_length_mean": float(np.mean(lengths)),
          "rl/completion_length_max": float(np.max(lengths)),
          "rl/truncated_fraction": float(np.mean(truncated)),
      }
    return Rollouts(out.prompts, completions, list(out.logprobs), np.asarray(out.lengths), shaped)

  def reward_model_scores(self, loop, prompts: list[list[int]], completions: list[list[int]]) -> np.ndarray:
    """[rows] float32 scores of the frozen reward model at each completion's last token, on rows laid out as in
    reward-model training (`preference.side_arrays`: the whole sequence in `inputs`)."""
    config = self.config
    rows = [
        preference_data.side_arrays(list(p), list(c), config.max_target_length, self.encoder.pad_id)
        for p, c in zip(prompts, completions)
    ]
    host = {key: np.stack([row[key] for row in rows]) for key in ("inputs", "positions", "segmentation")}
    batch = pipeline.process_local_batch(host, config, loop.mesh)
    scores = loop.role(REWARD_MODEL).run(forward.last_token_scalars, batch)
    return pipeline.local_rows(scores).astype(np.float32)

  def target_logps(self, model, batch: dict[str, jax.Array], temperature: jax.Array) -> jax.Array:
    """[N, L] log-probs of the targets under a model of the policy's kind: the reference's, or the old policy's."""
    return token_logps(model, batch, temperature, self.num_pieces)[0]

  def teacher_kl(
      self, logits: jax.Array, batch: dict[str, jax.Array], frozen, agg_mode: str
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(`rl.teacher_kl_coef` x the aggregated per-token KL(policy || teacher), {"teacher_kl": its token-mean or
    sequence-mean numerator}) on the completion tokens; (0, {}) without the term. `logits` are the policy's, tempered
    and masked as `token_logps` gives them; the teacher's are treated alike, so both are the sampled distributions."""
    if not self.rl.teacher_kl_coef:
      return jnp.zeros((), jnp.float32), {}
    teacher = token_logps(frozen[roles.TEACHER], batch, self.sampling.temperature, self.num_pieces)[1]
    kl = distillation.token_divergence(logits, teacher, "reverse_kl")
    mask = batch["completion_mask"]
    total = policy_gradient.aggregate(kl, mask, agg_mode, self.max_new_tokens)[0]
    mean_mode = "token-mean" if agg_mode == "token-mean" else "seq-mean-token-mean"
    return self.rl.teacher_kl_coef * total, {"teacher_kl": policy_gradient.aggregate(kl, mask, mean_mode)[0]}

  def headline_metrics(self, scalars: dict[str, Any]) -> dict[str, float]:
    """The rollouts' mean shaped reward (absent on steps that sample none), and the KL to the reference when the
    loss has a KL term."""
    names = {"reward": "rl/reward_mean"} | ({"kl": "learning/kl"} if self.rl.grpo_beta > 0 else {})
    return {name: float(scalars[key]) for name, key in names.items() if key in scalars}

  def evaluate(self, loop) -> dict[str, float]:
    if self.eval_prompts is None:
      return {}
    params = lora.policy_params(loop.policy(), self.config)
    metrics, samples = evaluate_lib.evaluate(loop.sampler(), params, self.eval_prompts, self.config, self.encoder)
    loop.cache["generations"] = samples
    loop.cache.setdefault("evaluations", {})[loop.step] = samples  # with per-prompt scores, for paired comparisons
    return {f"eval/{name}": value for name, value in metrics.items()}

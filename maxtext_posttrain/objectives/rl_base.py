"""What the RL objectives share: prompts, rollouts sampled by the run's sampler, their rewards, and pass@k evaluation.

GRPO and PPO both sample completions of training prompts with MaxText decoding (the run's one `rollout.Sampler`,
reading the policy's weights in place), score them with the reward functions of `rl.rewards` (plus DAPO's overlong
shaping) and, when `rl.rewards` names `reward_model`, with a frozen reward model (a `posttrain_mode=reward_model`
run's checkpoint, `reward_model_overrides.load_parameters_path`) run on the rollout rows. They differ in what they
make of the scores: group-relative advantages (GRPO) or a learned critic's GAE (PPO).

Sampling ahead (MaxText's `rl.off_policy_steps` = k >= 1): the rollouts a step trains on may be sampled up to k policy
updates earlier. At each step the objective dispatches the rollouts of the next steps (those k or fewer ahead that
start a rollout batch) with the current policy's weights, copied to the rollout mesh, before it scores its own (under
dynamic sampling, after its own extra rounds, which would otherwise queue behind them on the sampler's devices), and
goes on to train; JAX runs the decode program on the sampler's devices (`mesh.trainer_and_rollout_meshes`) while the
train step runs on the trainer's, and the host scores rewards meanwhile. The importance ratio's old log-probs are the
sampler's, so the loss corrects for the lag, which each step logs as `rl/staleness`. Nothing is dispatched across a
checkpoint: a step after which the models are saved samples nothing ahead, so the data iterator saved with a
checkpoint has handed out exactly the batches of the steps it holds, and a resumed run samples, from the checkpoint's
weights, what the uninterrupted run sampled (the first step after a checkpoint samples on-policy, staleness 0).

Where the reference scores rollouts (`rl.reference_devices`): on the trainer's devices, on the training rows before
the step (MaxText's RL), or on the sampler's, where it is built: each rollout batch's reference forward is dispatched
right behind its decode program, on the program's own arrays (`device_rows` builds the rows `training_rows` would: the
same log-probs, bit for bit on one device, up to float32 rounding across meshes), and comes back with the rollouts
(every round's batch under dynamic sampling, where the trainer's scores the chosen batch once). Sampling ahead on
devices of its own (a one-process job), the sampler's devices then run the next batch's decode and reference while
the trainer's run the train step, and the trainer's devices neither hold nor run the reference.

A rollout batch trained on over several steps (`rl.num_iterations`, PPO's `ppo.num_minibatches`) is usually
part-way through at a checkpoint: MaxText saves after steps 0, `checkpoint_period`, ..., each the first step of a
batch when the period is a multiple of the batch's steps. The batch's rows are saved with the objective's state
(`objective_state`), and a resumed run trains its remaining steps on them, as the uninterrupted run did.
"""

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import partitioning as nn_partitioning
from jax.experimental import multihost_utils
from maxtext.utils import max_logging

from maxtext_posttrain import config as config_lib
from maxtext_posttrain import evaluate as evaluate_lib
from maxtext_posttrain import forward
from maxtext_posttrain import objective_state
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
from maxtext_posttrain.rollout import tools as tools_lib

ROW_KEYS = ("inputs", "targets", "positions", "segmentation", "completion_mask", "old_logps", "advantages")
ROW_FLOATS = ("old_logps", "advantages")  # float32 columns of the rows; the others are int32
REWARD_MODEL = "reward_model"  # the name of the reward model in rl.rewards, and its role
REFERENCE_KEY = "reference_logps"  # the reference's log-probs: a column of the rows when the loss has a KL term
# Host state key: {"step": the saved step, "processes": the job's process count} when that step's rows hold the rollout
# batch the steps after it still train on (each process saved its own), None when the step ended its batch.
ROLLOUT_ROWS = "rollout_rows"
# Saved with the rows: the batch's prompts, which a resumed step that fails names (absent from rows saved before it was).
ROLLOUT_PROMPTS = "rollout_prompts"


def training_rows(
    prompts: list[list[int]],
    completions: list[list[int]],
    logprobs: list[np.ndarray] | None,
    length: int,
    window: int | None = None,
    sampled: list[np.ndarray | None] | None = None,
    reference: list[np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
  """[N, length] rows of prompt + completion, next-token shifted, with the sampler's log-probs on the targets.

  Row i holds prompt_i + completion_i without its last token as inputs; `completion_mask` is 1 where the target is
  a completion token the policy sampled (`sampled[i]`, when tools inserted some: 0 on a tool's answer; None: all), and
  `old_logps` there is the sampler's log-prob of that token (no `old_logps` without `logprobs`: completions nobody
  sampled). `reference`, the reference's log-probs of each completion's tokens (`rl.reference_devices=sampler`),
  becomes the `REFERENCE_KEY` column there. Padding has segment id 0. With `window` (the losses' `completion_index`
  width), each completion and the `window` positions from its start must fit in the row. `device_rows` builds the
  same rows on the devices.
  """
  rows = {key: np.zeros((len(prompts), length), np.int32) for key in ROW_KEYS[:5]}
  if logprobs is not None:
    if len(logprobs) != len(prompts):
      raise ValueError(f"{len(logprobs)} log-prob arrays for {len(prompts)} rows.")
    rows["old_logps"] = np.zeros((len(prompts), length), np.float32)
  if reference is not None:
    rows[REFERENCE_KEY] = np.zeros((len(prompts), length), np.float32)
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
    mask = 1 if sampled is None or sampled[i] is None else sampled[i][: len(completion)]
    if len(completion) and not np.atleast_1d(mask)[0]:
      raise ValueError(f"Row {i}: its completion starts with a tool's answer; the window starts at a sampled token.")
    if window is not None and (len(completion) > window or start + window > length):
      raise ValueError(f"Row {i}: a {len(completion)}-token completion at {start} leaves a {window}-token window.")
    rows["completion_mask"][i, start : start + len(completion)] = mask
    if logprobs is not None:
      rows["old_logps"][i, start : start + len(completion)] = logprobs[i][: len(completion)]
    if reference is not None:
      rows[REFERENCE_KEY][i, start : start + len(completion)] = reference[i][: len(completion)]
  return rows


def device_rows(
    prompt_tokens: jax.Array, prompt_lengths: jax.Array, tokens: jax.Array, lengths: jax.Array, length: int
) -> dict[str, jax.Array]:
  """`training_rows`' inputs, targets, positions, segmentation and completion_mask, built on the devices from a
  decode program's arrays: [rows, bucket] right-padded prompt tokens with their [rows] lengths, [rows, T] completion
  tokens with theirs (`rollout.PendingRollouts`), so rollouts are scored where they were sampled."""
  bucket, new_tokens = prompt_tokens.shape[1], tokens.shape[1]
  column = jnp.arange(length, dtype=jnp.int32)[None, :]
  prompt_length, last = prompt_lengths[:, None], (prompt_lengths + lengths - 1)[:, None]  # last: inputs end there

  def sequence(at):  # token `at` of prompt + completion (anything past its end: masked below)
    prompt = jnp.take_along_axis(prompt_tokens, jnp.clip(at, 0, bucket - 1), axis=1)
    completion = jnp.take_along_axis(tokens, jnp.clip(at - prompt_length, 0, new_tokens - 1), axis=1)
    return jnp.where(at < prompt_length, prompt, completion)

  inside = column < last
  start = prompt_length - 1
  return {
      "inputs": jnp.where(inside, sequence(column), 0),
      "targets": jnp.where(inside, sequence(column + 1), 0),
      "positions": jnp.broadcast_to(column, inside.shape),
      "segmentation": inside.astype(jnp.int32),
      "completion_mask": ((column >= start) & (column < start + lengths[:, None])).astype(jnp.int32),
  }


def token_logps(
    model, batch: dict[str, jax.Array], temperature: jax.Array, num_pieces=None, enable_dropout=False, logit_index=None
):
  """([N, L] log-probs of the rows' targets under softmax(logits / T), the [N, L, V] tempered logits); at
  `logit_index`'s [N, W] positions only when given ([N, W], [N, W, V])."""
  return forward.token_logps(
      model,
      batch["inputs"],
      batch["positions"],
      batch["segmentation"],
      batch["targets"],
      temperature,
      num_pieces,
      enable_dropout,
      logit_index,
  )


def completion_index(batch: dict[str, jax.Array], width: int) -> jax.Array:
  """[N, width] positions of each row's completion window: `width` (max_new_tokens) positions from its first
  completion target on (a row without one: from 0). The policy losses and the reference read the LM head there only,
  so the prompt's logits are never computed; `training_rows(window=width)` checks that the window fits."""
  start = jnp.argmax(batch["completion_mask"], axis=1).astype(jnp.int32)
  return start[:, None] + jnp.arange(width, dtype=jnp.int32)


def at_index(rows: jax.Array, index: jax.Array) -> jax.Array:
  """[N, W] the values of [N, L] `rows` at `index`'s positions."""
  return jnp.take_along_axis(rows, index, axis=1)


def reward_model_role(config) -> roles.RoleSpec:
  """The frozen reward model: a scalar-head model of the run's config plus `reward_model_overrides`."""
  overrides = dict(config.reward_model_overrides)
  if not overrides.get("load_parameters_path"):
    raise config_lib.ConfigError(
        "rl.rewards names reward_model but reward_model_overrides.load_parameters_path is not set: point it at the "
        "checkpoint of a posttrain_mode=reward_model run (<run>/checkpoints/<step>/items)."
    )
  return roles.RoleSpec(
      REWARD_MODEL, trained=False, head="scalar", overrides_key="reward_model_overrides", overrides=overrides
  )


def warn_of_k1_in_the_loss(rl) -> None:
  """Warns when the loss's KL term is the k1 estimate: log(pi / pi_ref) of the sampled tokens, whose gradient is the
  score function, zero in expectation over the policy's own samples, so the term pulls towards the reference only as
  noise (k1 as a reward, PPO's ppo.kl_penalty=reward, is what it is for). Tunix and verl accept it, so it runs."""
  if rl.kl_estimator == "k1":
    max_logging.warning(
        "rl.kl_estimator=k1 in the loss: the gradient of log(pi / pi_ref) on the policy's own samples is zero in "
        "expectation, so this KL term does not hold the policy to the reference; k3 (or k2) does."
    )


def check_config(config, min_generations: int) -> None:
  """Raises ValueError naming the key for rl.* settings an RL objective cannot honour."""
  rl = config.rl
  mode = f"posttrain_mode={config.posttrain_mode}"
  budget = config_lib.max_new_tokens(config)
  if budget < 1:
    raise config_lib.ConfigError(
        f"{mode} generates max_target_length - max_prefill_predict_length tokens per completion; "
        f"{config.max_target_length} - {config.max_prefill_predict_length} leaves none."
    )
  if rl.overlong_buffer_length >= budget:
    raise config_lib.ConfigError(
        f"rl.overlong_buffer_length={rl.overlong_buffer_length} must be below the generation budget "
        f"max_target_length - max_prefill_predict_length = {budget} tokens."
    )
  if rl.num_generations < min_generations:
    raise config_lib.ConfigError(
        f"rl.num_generations={rl.num_generations}: {mode} needs at least {min_generations} completions per prompt."
    )
  if config.packing:
    raise config_lib.ConfigError(f"{mode} trains on one row per completion; set packing=false.")
  if rl.reward_weights and len(rl.reward_weights) != len(rl.rewards):
    raise config_lib.ConfigError(
        f"rl.reward_weights {rl.reward_weights} needs one weight per reward of rl.rewards {rl.rewards}."
    )
  if rl.use_agentic_rollout:
    raise config_lib.ConfigError(
        f"{mode} does not support rl.use_agentic_rollout: rollouts are sampled by MaxText decoding (rl.off_policy_steps "
        "samples them ahead of the step that trains on them; rl.tools gives them tools)."
    )
  if rl.dynamic_sampling_metric not in (config_lib.SHAPED_REWARD, config_lib.REWARD_SUM, *rl.rewards):
    raise config_lib.ConfigError(
        f"rl.dynamic_sampling_metric={rl.dynamic_sampling_metric!r}: expected {config_lib.SHAPED_REWARD!r}, "
        f"{config_lib.REWARD_SUM!r} or a reward of rl.rewards {list(rl.rewards)}."
    )
  if rl.dynamic_sampling_metric != config_lib.SHAPED_REWARD and not rl.dynamic_sampling:
    raise config_lib.ConfigError(
        f"rl.dynamic_sampling_metric={rl.dynamic_sampling_metric} applies with rl.dynamic_sampling=true."
    )
  if rl.grpo_beta < 0:
    raise config_lib.ConfigError(f"rl.grpo_beta={rl.grpo_beta}: the KL coefficient must be >= 0 (0: no KL term).")
  if rl.off_policy_steps < 0:
    raise config_lib.ConfigError(f"rl.off_policy_steps={rl.off_policy_steps} must be >= 0.")
  if rl.off_policy_steps and not rl.use_rollout_logps:
    raise config_lib.ConfigError(
        f"rl.off_policy_steps={rl.off_policy_steps} needs rl.use_rollout_logps=true: the importance ratio corrects "
        "for the lag with the sampler's log-probs; the trainer's re-scoring would give the current policy's (ratio 1)."
    )
  if rl.off_policy_steps and rl.force_on_policy_ratio:
    raise config_lib.ConfigError(
        f"rl.force_on_policy_ratio=true pins the ratio to 1, which rollouts sampled {rl.off_policy_steps} step(s) "
        "ahead (rl.off_policy_steps) are not."
    )
  if rl.reference_devices == "sampler":
    refusals = {
        "this run has no reference (rl.grpo_beta=0)": rl.grpo_beta <= 0,
        f"rl.tools={list(rl.tools)} finish rollouts on the host, in turns after the decode program": bool(rl.tools),
        "under LoRA the reference is the policy's base with its starting adapters, on the trainer's devices": (
            lora.enabled(config)
        ),
    }
    for reason, refused in refusals.items():
      if refused:
        raise config_lib.ConfigError(
            "rl.reference_devices=sampler scores each rollout batch with the reference right after its decode "
            f"program, but {reason}; set rl.reference_devices=trainer."
        )
  if max(config.eval_pass_at_k) > config.eval_samples_per_prompt or min(config.eval_pass_at_k) < 1:
    raise config_lib.ConfigError(
        f"eval_pass_at_k={config.eval_pass_at_k} needs 1 <= k <= "
        f"eval_samples_per_prompt={config.eval_samples_per_prompt}."
    )


def gathered(values: np.ndarray) -> np.ndarray:
  """Every process's `values` (rows of its part of the batch), concatenated in process order: the whole batch's
  rows, for statistics and decisions all processes must share."""
  return np.asarray(multihost_utils.process_allgather(np.asarray(values), tiled=True))


@dataclasses.dataclass
class Rollouts:
  """Sampled completions of this process's prompts, scored; row r is sample r % n of prompt r // n."""

  indices: list[int]  # per prompt, its index in the training split
  prompts: list[list[int]]  # per row, as the sampler saw it (left-truncated when longer than the prefill length)
  completions: list[list[int]]
  logprobs: list[np.ndarray]
  lengths: np.ndarray
  rewards: np.ndarray  # [rows], shaped: the weighted reward sum plus the overlong penalty
  # [rows] each: every reward's own score by its name in rl.rewards, and their weighted sum before shaping
  # (config.REWARD_SUM), the scores rl.dynamic_sampling_metric may name
  scores: dict[str, np.ndarray]
  sampled: list[np.ndarray] | None = None  # with rl.tools, per row: 1 on the tokens the policy sampled, 0 on answers
  reference: list[np.ndarray] | None = None  # rl.reference_devices=sampler: the reference's log-probs per completion


@dataclasses.dataclass
class _Dispatched:
  """Rollouts whose decode program is dispatched: this process's prompt indices and the sampler's pending result."""

  indices: list[int]
  pending: rollout.PendingRollouts | tools_lib.PendingToolRollouts
  params_step: int  # the step whose weights sample them
  started: float  # perf_counter at dispatch
  reference: jax.Array | None = None  # rl.reference_devices=sampler: the reference's [rows, T] log-probs, dispatched


class RLObjective(Objective):
  """Prompts, rollouts, rewards and evaluation of an RL objective; subclasses turn rollouts into training rows."""

  example_unit = "prompts"

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
      try:
        self.rewards = rewards_lib.RewardSet(
            [n for n, _ in functions], [w for _, w in functions], rl.reward_on_error, rl.reward_timeout_seconds
        )
      except rewards_lib.RewardSpecError as error:
        raise config_lib.ConfigError(f"rl.rewards={list(rl.rewards)}: {error}") from error
    self.reward_model_weight = dict(zip(rl.rewards, weights)).get(REWARD_MODEL)
    if self.reward_model_weight is not None:
      self.roles += (reward_model_role(config),)
    if rl.teacher_kl_coef > 0:
      self.roles += (roles.teacher(config, f"rl.teacher_kl_coef={rl.teacher_kl_coef}"),)
    self.encoder = pipeline.Encoder.from_config(config)
    self.num_pieces = self.encoder.num_pieces  # ids the sampler can draw; the loss scores the same distribution
    tools_lib.stop_tokens([tools_lib.load(spec) for spec in rl.tools], self.encoder)  # fails at start, not at sampling
    self.train_prompts = self.eval_prompts = None
    self.step_metrics = {}  # host-side metrics of the last step (rollout, rewards, timings), logged with its own
    self.rollout_prompts: list[int] = []  # this process's prompts of the rollout batch being trained on
    self._trained_prompts: dict[int, list[int]] = {}  # by step, for the steps not yet checked (`step_examples`)
    self.steps_per_rollout = rl.num_iterations  # steps trained on one rollout batch
    self.off_policy_steps = rl.off_policy_steps
    self._ahead: dict[int, _Dispatched] = {}  # rollouts dispatched ahead, by the step that trains on them
    self._sampler = None  # built on first use, from the run's sampler

  def sampler(self, loop) -> rollout.Sampler | tools_lib.ToolUse:
    """What samples rollouts: the run's sampler, in turns with `rl.tools` (both `start` a batch alike)."""
    if self._sampler is None:
      self._sampler = tools_lib.with_tools(loop.sampler(), self.config, self.encoder)
    return self._sampler

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
    # The trainer checks a step's figures a step later, when the next step may have drawn new rollouts: kept by step.
    self._trained_prompts = {s: p for s, p in self._trained_prompts.items() if s >= step - 1}
    self._trained_prompts[step] = self.trained_prompts()

  def trained_prompts(self) -> list[int]:
    """The prompts of the rows this process's block of the step just dispatched trains on."""
    return sorted(set(self.rollout_prompts))

  def indices(self, batch) -> list[int]:
    """This process's prompts of the step: the indices in its block of the batch's rows."""
    return [int(i) for i in pipeline.local_rows(batch[prompts_lib.INDEX_KEY])[:, 0]]

  def starts_rollout(self, loop) -> bool:
    """Whether this step trains on a new rollout batch (else on the current one, another iteration or minibatch)."""
    del loop
    return True

  def wants_batch(self, loop) -> bool:
    return self.starts_rollout(loop) and loop.step not in self._ahead

  def _continues_rollout(self, step: int) -> bool:
    """Whether the step after `step` trains on the rollout batch `step` trained on."""
    return (step + 1) % self.steps_per_rollout != 0

  def host_state(self, step: int) -> dict[str, Any]:
    if self.steps_per_rollout == 1:
      return {}
    rows = {"step": step, "processes": jax.process_count()} if self._continues_rollout(step) else None
    return {ROLLOUT_ROWS: rows}

  def host_rows(self, step: int) -> dict[str, np.ndarray] | None:
    if self.steps_per_rollout == 1 or not self._continues_rollout(step):
      return None
    return self.rollout_rows() | {ROLLOUT_PROMPTS: np.asarray(self.rollout_prompts, np.int64)}

  def load_host_state(self, state: dict[str, Any]) -> None:
    if state.get(ROLLOUT_ROWS) is not None:
      step, processes = state[ROLLOUT_ROWS]["step"], state[ROLLOUT_ROWS]["processes"]
      rows = objective_state.restore_rows(self.config, step, processes)
      self.rollout_prompts = [int(i) for i in rows.pop(ROLLOUT_PROMPTS, ())]
      self.resume_rollout(rows, step - step % self.steps_per_rollout)

  def rollout_rows(self) -> dict[str, np.ndarray]:
    """This process's rows of the current rollout batch (what `host_rows` saves part-way through one)."""
    raise NotImplementedError

  def resume_rollout(self, rows: dict[str, np.ndarray], rollout_step: int) -> None:
    """Takes `rollout_rows` saved part-way through the rollout batch drawn at `rollout_step` as the current batch."""
    raise NotImplementedError

  def step_rollouts(self, loop, batch, metrics: dict, ahead: bool = True) -> Rollouts:
    """This step's rollouts, scored: sampled ahead by an earlier step, else now from `batch`'s prompts. Before
    scoring them, dispatches the next steps' rollouts (`_dispatch_ahead`) unless `ahead` is false: a step that
    samples more rounds of its own dispatches them after those. With tools, after this step's later turns, which
    would otherwise queue behind the next step's first turn on the sampler's devices."""
    dispatched = self._ahead.pop(loop.step, None) or self._dispatch(loop, self.indices(batch), loop.step, 0)
    waiting = time.perf_counter()
    if ahead and self.rl.tools:
      dispatched.pending.result()
    if ahead:
      self._dispatch_ahead(loop)
    self.rollout_prompts = list(dispatched.indices)
    return self._score(loop, dispatched, metrics, waiting)

  def sample(self, loop, indices: list[int], round_index: int, metrics: dict | None) -> Rollouts:
    """`rl.num_generations` completions for each of this process's prompts, sampled now with the current policy
    (round `round_index` of this step) and scored (see `_score`). They are the batch's prompts; a step that samples
    more rounds (GRPO's dynamic sampling) names the ones it keeps once it has chosen them."""
    self.rollout_prompts = list(indices)
    return self._score(loop, self._dispatch(loop, indices, loop.step, round_index), metrics)

  def step_examples(self, step: int, batch) -> list[int]:
    del batch
    return self._trained_prompts.get(step, [])

  def _dispatch_ahead(self, loop) -> None:
    """Dispatches, with the current weights, the rollouts of each step up to `rl.off_policy_steps` ahead that starts
    a rollout batch, unless the models are saved before it (see the module docstring) or the run ends first. Their
    prompt batches are drawn from the iterator in step order.

    A step calls it before its train step updates the weights, as early as it can: before scoring its rollouts, so
    the next ones decode meanwhile, or, when it samples more rounds of its own (dynamic sampling), after those:
    the sampler's devices run programs in the order they come, so rounds dispatched after the next step's rollouts
    would wait for them. Steps that train on an earlier rollout batch call it too, so that a batch of several steps
    can be sampled during the last of its predecessor's."""
    for target in range(loop.step + 1, loop.step + self.off_policy_steps + 1):
      if target >= self.config.steps or any(objective_state.due(self.config, s) for s in range(loop.step, target)):
        return
      if target % self.steps_per_rollout == 0 and target not in self._ahead:
        indices = self.indices(loop.train_batches.load_next_batch())
        self._ahead[target] = self._dispatch(loop, indices, target, 0, copy_params=True)

  def _dispatch(self, loop, indices: list[int], step: int, round_index: int, copy_params=False) -> _Dispatched:
    """Dispatches the sampling of `rl.num_generations` completions of each of this process's prompts, for `step`
    (its keys: the same whichever step samples them), with the current policy's weights (`process_local`)."""
    rng = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.rl.sampling_seed), step), round_index)
    started = time.perf_counter()
    pending = self.sampler(loop).start(
        loop.policy_params(),
        [list(self.train_prompts.prompt_ids[i]) for i in indices],
        self.max_new_tokens,
        self.encoder.tokenizer.eos_id,
        rng,
        self.sampling,
        num_samples=self.rl.num_generations,
        process_local=True,
        copy_params=copy_params,
    )
    reference = None
    if self.rl.reference_devices == "sampler":  # queued behind the decode program on the sampler's devices
      (prompt_tokens, prompt_lengths), (tokens, _, lengths) = pending.inputs, pending.outputs
      model = loop.role(roles.REFERENCE)
      with model.scope():  # the prompts padded from their bucket to the longest: one program serves every bucket
        bucket = prompt_tokens.shape[1]
        prompt_tokens = jnp.pad(prompt_tokens, ((0, 0), (0, self.config.max_prefill_predict_length - bucket)))
      temperature = np.float32(self.sampling.temperature)
      reference = model.run(self.rollout_logps, prompt_tokens, prompt_lengths, tokens, lengths, temperature)
    return _Dispatched(indices, pending, loop.step, started, reference)

  def _score(self, loop, dispatched: _Dispatched, metrics: dict | None, waiting: float | None = None) -> Rollouts:
    """Waits for dispatched rollouts and scores them here, each row once, on the process that owns it; adds the whole
    batch's rollout statistics to `metrics` (if given): `rl/rollout_seconds` is the time this step spent on them
    (sampling, or only waiting, since `waiting`, when they were sampled ahead), `rl/reference_seconds` (with
    rl.reference_devices=sampler) how long it then waited for the reference's log-probs, and `rl/staleness` the
    policy updates between the weights that sampled them and the weights they train."""
    rl, prompt_set, indices = self.rl, self.train_prompts, dispatched.indices
    num_samples = rl.num_generations
    start = dispatched.started if dispatched.params_step == loop.step else (waiting or time.perf_counter())
    out = dispatched.pending.result()
    rollout_seconds, start = time.perf_counter() - start, time.perf_counter()
    reference = None
    if dispatched.reference is not None:  # rl.reference_devices=sampler: the reference, run behind the decode
      reference = list(pipeline.local_rows(dispatched.reference)[: len(out.prompts)])
    reference_seconds = time.perf_counter() - start
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
      if reference is not None:
        metrics["rl/reference_seconds"] = reference_seconds
      metrics |= {
          "rl/rollout_seconds": rollout_seconds,
          "rl/staleness": float(loop.step - dispatched.params_step),
          "rl/reward_seconds": reward_seconds,
          "rl/overlong_penalty": float(penalty.mean()),
          "rl/completion_length_mean": float(np.mean(lengths)),
          "rl/completion_length_max": float(np.max(lengths)),
          "rl/truncated_fraction": float(np.mean(truncated)),
      }
      if out.tool_calls is not None:
        calls, errors = gathered(np.stack([out.tool_calls, out.tool_errors], axis=1).astype(np.float32)).T
        metrics |= {"rl/tool_calls_mean": float(calls.mean()), "rl/tool_calls_max": float(calls.max())}
        metrics["rl/tool_errors"] = float(errors.sum())
    scores = per_function | {config_lib.REWARD_SUM: total}
    sampled = None if out.sampled is None else list(out.sampled)
    return Rollouts(
        indices, out.prompts, completions, list(out.logprobs), np.asarray(out.lengths), shaped, scores, sampled, reference
    )

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
    """[N, L] log-probs of the targets under a model of the policy's kind (the reference's, or the old policy's),
    computed on the completion windows (0 elsewhere)."""
    index = completion_index(batch, self.max_new_tokens)
    logps = token_logps(model, batch, temperature, self.num_pieces, logit_index=index)[0]
    rows = jnp.arange(index.shape[0])[:, None]
    out = jnp.zeros(batch["targets"].shape, jnp.float32).at[rows, index].set(logps)
    # Laid out as the batch's columns are (a fresh array's layout would be replicated), for the train step's inputs.
    return nn_partitioning.with_sharding_constraint(out, tuple(self.config.input_data_sharding_logical_axes))

  def rollout_logps(
      self,
      model,
      prompt_tokens: jax.Array,
      prompt_lengths: jax.Array,
      tokens: jax.Array,
      lengths: jax.Array,
      temperature: jax.Array,
  ) -> jax.Array:
    """[rows, T] log-probs of a decode program's completion tokens (0 past each one's end) under a model of the
    policy's kind, from the program's arrays (`rollout.PendingRollouts`: a prompt's row repeated to its samples), on
    the rows `training_rows` would build, so they equal `target_logps` at the completion tokens."""
    num_samples = tokens.shape[0] // prompt_tokens.shape[0]
    prompt_tokens, prompt_lengths = (jnp.repeat(x, num_samples, axis=0) for x in (prompt_tokens, prompt_lengths))
    batch = device_rows(prompt_tokens, prompt_lengths, tokens, lengths, self.config.max_target_length)
    index = completion_index(batch, self.max_new_tokens)
    logps = token_logps(model, batch, temperature, self.num_pieces, logit_index=index)[0]
    logps = jnp.where(jnp.arange(logps.shape[1])[None, :] < lengths[:, None], logps, 0.0)
    # Split over the batch only, as the decode program's outputs are (`local_rows` takes this process's rows).
    return nn_partitioning.with_sharding_constraint(logps, (self.config.input_data_sharding_logical_axes[0], None))

  def policy_window(self, model, batch: dict[str, jax.Array], is_train: bool):
    """(the policy's [N, W] log-probs and [N, W, V] tempered logits on each row's completion window, the window's
    positions `completion_index`, the rows' per-token columns there: completion_mask, old_logps, advantages and the
    reference's log-probs when the batch has them): what the policy losses read."""
    index = completion_index(batch, self.max_new_tokens)
    dropout = self.config.enable_dropout and is_train
    logps, logits = token_logps(model, batch, self.sampling.temperature, self.num_pieces, dropout, index)
    columns = ("completion_mask", "old_logps", "advantages", REFERENCE_KEY)
    return logps, logits, index, {key: at_index(batch[key], index) for key in columns if key in batch}

  def teacher_kl(
      self, logits: jax.Array, batch: dict[str, jax.Array], index: jax.Array, frozen, agg_mode: str
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(`rl.teacher_kl_coef` x the aggregated per-token KL(policy || teacher), {"teacher_kl": its token-mean or
    sequence-mean numerator}) on the completion tokens; (0, {}) without the term. `logits` are the policy's at
    `index` (`completion_index`), tempered and masked as `token_logps` gives them; the teacher's are read alike, so
    both are the sampled distributions."""
    if not self.rl.teacher_kl_coef:
      return jnp.zeros((), jnp.float32), {}
    teacher = token_logps(frozen[roles.TEACHER], batch, self.sampling.temperature, self.num_pieces, logit_index=index)[1]
    kl = distillation.token_divergence(logits, teacher, "reverse_kl")
    mask = at_index(batch["completion_mask"], index)
    total = policy_gradient.aggregate(kl, mask, agg_mode, self.max_new_tokens)[0]
    mean_mode = "token-mean" if agg_mode == "token-mean" else "seq-mean-token-mean"
    return self.rl.teacher_kl_coef * total, {"teacher_kl": policy_gradient.aggregate(kl, mask, mean_mode)[0]}

  def headline_metrics(self, scalars: dict[str, Any]) -> dict[str, float]:
    """The rollouts' mean shaped reward (absent on steps that sample none), the KL to the reference when the loss has
    a KL term, and the KL to the teacher when it has that (`rl.teacher_kl_coef`)."""
    names = {"reward": "rl/reward_mean"} | ({"kl": "learning/kl"} if self.rl.grpo_beta > 0 else {})
    names |= {"teacher_kl": "learning/teacher_kl"} if self.rl.teacher_kl_coef > 0 else {}
    return {name: float(scalars[key]) for name, key in names.items() if key in scalars}

  def evaluate(self, loop) -> dict[str, float]:
    if self.eval_prompts is None:
      return {}
    params = loop.policy_params()
    metrics, samples = evaluate_lib.evaluate(self.sampler(loop), params, self.eval_prompts, self.config, self.encoder)
    loop.cache["generations"] = samples
    # The first and the latest evaluations' samples, with per-prompt scores, for paired comparisons (the demo's
    # before/after table); those in between are dropped, so host memory does not grow with every evaluation.
    evaluations = loop.cache.setdefault("evaluations", {})
    evaluations[loop.step] = samples
    for step in sorted(evaluations)[1:-1]:
      del evaluations[step]
    return {f"eval/{name}": value for name, value in metrics.items()}

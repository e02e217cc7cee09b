"""The GRPO family: critic-free RL from G sampled completions per prompt, scored by reward functions.

`posttrain_mode` is one of grpo, drgrpo, dapo, gspo, gspo_token, rloo: one objective whose `rl.*` keys
(`config.RL_PRESETS`) make the variant, so any mode can be adjusted key by key (`posttrain_mode=grpo
rl.loss_algo=gspo-token` is MaxText's way of asking for GSPO-token).

A step, on the host (`before_step`): the prompt iterator yields this step's prompt indices; the rollout sampler
(MaxText decoding with the KV cache, on the trainer's mesh, reading the policy's weights in place) draws G completions
per prompt with their log-probs; the rewards score them (plus DAPO's overlong shaping); group advantages follow; with
dynamic sampling, groups whose rewards all agree (`rl.dynamic_sampling_metric`: the shaped reward, the sum before
shaping, or one reward) are replaced by fresh prompts' groups for up to `rl.max_sampling_rounds` rounds (the batch
chosen from every process's groups, as one process would choose: `GRPO._block`); with `rl.grpo_beta` > 0 the frozen
reference scores the batch (`rl.reference_devices=sampler`: on the sampler's devices, as each rollout batch is
decoded). Rows are prompt + completion, one per sample, with the sampler's log-probs as the old policy's. The jitted
step then differentiates the clipped surrogate (`losses.policy_gradient`). With `rl.num_iterations` = mu > 1 the same
rollout batch is trained on for mu steps (GRPO's inner iterations), the old log-probs fixed at sampling time.
"""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxtext_posttrain import config as config_lib
from maxtext_posttrain import roles
from maxtext_posttrain.data import pipeline
from maxtext_posttrain.losses import advantages as advantages_lib
from maxtext_posttrain.losses import logprobs as logprobs_lib
from maxtext_posttrain.losses import policy_gradient
from maxtext_posttrain.objectives.rl_base import REFERENCE_KEY, ROW_FLOATS, ROW_KEYS, RLObjective, gathered
from maxtext_posttrain.objectives.rl_base import training_rows, warn_of_k1_in_the_loss
from maxtext_posttrain.objectives.base import LossOutput, register, rows_spec

_ALGOS = {"grpo": "grpo", "gspo": "gspo", "gspo-token": "gspo_token"}


@dataclasses.dataclass
class _Group:
  """One prompt's G samples, scored."""

  index: int  # the prompt's index in the training split
  prompt: list[int]  # as the sampler saw it (left-truncated when longer than max_prefill_predict_length)
  completions: list[list[int]]
  logprobs: list[np.ndarray]
  rewards: np.ndarray  # [G], shaped: the weighted reward sum plus the overlong penalty
  filter_scores: np.ndarray  # [G], rl.dynamic_sampling_metric's score
  sampled: list[np.ndarray] | None = None  # with rl.tools: per completion, 1 on the tokens the policy sampled
  reference: list[np.ndarray] | None = None  # rl.reference_devices=sampler: the reference's log-probs per completion

  @property
  def informative(self) -> bool:
    """Whether dynamic sampling keeps the group: its samples' filter scores do not all agree."""
    return bool(np.any(self.filter_scores != self.filter_scores[0]))


class GRPO(RLObjective):
  """`posttrain_mode=grpo` (and the presets registered below): group-relative policy optimisation."""

  name = "grpo"
  batch_keys = ROW_KEYS

  def __init__(self, config):
    super().__init__(config, min_generations=2)
    rl = self.rl
    if rl.dual_clip is not None and rl.loss_algo != "grpo":
      raise config_lib.ConfigError(f"rl.dual_clip applies to rl.loss_algo=grpo, not {rl.loss_algo}.")
    if rl.force_on_policy_ratio and rl.num_iterations > 1:
      raise config_lib.ConfigError(
          "rl.force_on_policy_ratio=true pins the ratio to 1, which only holds for rl.num_iterations=1."
      )
    if rl.grpo_beta > 0:
      self.roles += (roles.reference(on_rollout_mesh=rl.reference_devices == "sampler"),)
      self.batch_keys = ROW_KEYS + (REFERENCE_KEY,)
      warn_of_k1_in_the_loss(rl)
    self.algo = _ALGOS[rl.loss_algo]
    self.agg_mode = config_lib.AGG_MODE_ALIASES[rl.loss_agg_mode]
    self._old_policy = None  # the policy's forward under jit, for rl.use_rollout_logps=false
    self._batch = None  # the rollout batch of the current num_iterations cycle
    self._resumed_rows = None  # its rows on the host, restored part-way through it, until the first step places them

  def starts_rollout(self, loop) -> bool:
    return (self._batch is None and self._resumed_rows is None) or loop.step % self.steps_per_rollout == 0

  def rollout_rows(self) -> dict[str, np.ndarray]:
    return {key: pipeline.local_rows(value) for key, value in self._batch.items()}

  def resume_rollout(self, rows: dict[str, np.ndarray], rollout_step: int) -> None:
    del rollout_step
    self._resumed_rows = rows

  def batch_spec(self, train: bool = True) -> dict[str, jax.ShapeDtypeStruct] | None:
    """`rl_base.training_rows` of every prompt's G completions with their advantages (and reference log-probs); no
    held-out loss pass."""
    if not train:
      return None
    rows = self.config.global_batch_size_to_load * self.rows_per_example
    return rows_spec(rows, self.config.max_target_length, self.batch_keys, ROW_FLOATS + (REFERENCE_KEY,))

  def before_step(self, loop, batch):
    if not self.starts_rollout(loop):  # another iteration on the cycle's rollouts; old log-probs from sampling time
      if self._batch is None:
        self._batch, self._resumed_rows = pipeline.process_local_batch(self._resumed_rows, self.config, loop.mesh), None
      self._dispatch_ahead(loop)
      self.step_metrics = {"rl/iteration": float(loop.step % self.rl.num_iterations)}
      return self._batch
    timer, metrics = time.perf_counter(), {"rl/iteration": 0.0}
    more_rounds = self.rl.dynamic_sampling and self.rl.max_sampling_rounds > 1
    groups = first_round = self._groups(self.step_rollouts(loop, batch, metrics, ahead=not more_rounds))
    num_prompts, rounds = len(groups), 1
    while more_rounds and rounds < self.rl.max_sampling_rounds:
      # Sampling is collective: every process samples another round until the whole batch has enough informative groups.
      if gathered(np.array([sum(g.informative for g in groups)])).sum() >= num_prompts * jax.process_count():
        break
      groups += self._groups(self.sample(loop, self.indices(loop.train_batches.load_next_batch()), rounds, None))
      rounds += 1
    if more_rounds:
      self._dispatch_ahead(loop)
    groups, masked_here, masked = self._block(groups, num_prompts)
    self.rollout_prompts = [g.index for g in groups]
    rewards = gathered(np.stack([g.rewards for g in first_round]))  # [prompts of the whole batch, G]
    metrics |= {
        "rl/reward_mean": float(rewards.mean()),
        "rl/reward_std": float(rewards.std()),
        "rl/zero_variance_fraction": float(np.mean(np.all(rewards == rewards[:, :1], axis=1))),
        "rl/sampling_rounds": float(rounds),
        "rl/masked_groups": float(masked),
        "rl/reward_errors": self.reward_errors(),
    }
    batch = self._device_batch(loop, groups, masked_here)
    temperature = jnp.float32(self.sampling.temperature)
    if not self.rl.use_rollout_logps:  # MaxText's re-forward path: the trainer scores the rollouts before the step
      self._old_policy = self._old_policy or roles.FrozenModel(roles.reference(), self.config, loop.mesh, None, None)
      self._old_policy.graphdef, self._old_policy.state = nnx.split(loop.policy())
      batch["old_logps"] = self._old_policy.run(self.target_logps, batch, temperature)
    if self.rl.grpo_beta > 0 and self.rl.reference_devices == "trainer":  # else the rows carry the sampler's
      start = time.perf_counter()
      batch[REFERENCE_KEY] = jax.block_until_ready(loop.role("reference").run(self.target_logps, batch, temperature))
      metrics["rl/reference_seconds"] = time.perf_counter() - start
    metrics["rl/before_step_seconds"] = time.perf_counter() - timer
    self._batch = batch
    self.step_metrics = metrics
    return self._batch

  def _groups(self, out) -> list[_Group]:
    """Rollouts of G completions per prompt as one group per prompt."""
    group_size, metric = self.rl.num_generations, self.rl.dynamic_sampling_metric
    filter_scores = out.rewards if metric == config_lib.SHAPED_REWARD else out.scores[metric]
    return [
        _Group(
            index=out.indices[p],
            prompt=out.prompts[p * group_size],
            completions=out.completions[p * group_size : (p + 1) * group_size],
            logprobs=out.logprobs[p * group_size : (p + 1) * group_size],
            rewards=out.rewards[p * group_size : (p + 1) * group_size],
            filter_scores=filter_scores[p * group_size : (p + 1) * group_size],
            sampled=None if out.sampled is None else out.sampled[p * group_size : (p + 1) * group_size],
            reference=None if out.reference is None else out.reference[p * group_size : (p + 1) * group_size],
        )
        for p in range(len(out.prompts) // group_size)
    ]

  def _block(self, groups: list[_Group], num_prompts: int) -> tuple[list[_Group], int, int]:
    """This process's `num_prompts` groups of the batch, how many of them are masked out, and how many of the whole
    batch's are.

    Without dynamic sampling: the groups of its own prompts. With it, the whole batch is chosen from every process's
    groups as one process would choose from them all (`select`, in the order one process samples them: round by
    round, each round's in batch order), so the informative groups one process has to spare fill another's slots,
    and each process takes its block of the choice, groups other processes sampled included (`_moved`)."""
    if not self.rl.dynamic_sampling:
      return groups, 0, 0
    processes, me = jax.process_count(), jax.process_index()
    total = num_prompts * processes
    # Every process's flags, [processes, rounds, prompts], in one process's order: round 0's whole batch, round 1's, ...
    flags = gathered(np.array([g.informative for g in groups])).reshape(processes, -1, num_prompts)
    chosen, masked = select(flags.transpose(1, 0, 2).reshape(-1), total)
    # Slot q of that order is prompt q % total of round q // total: the owner's group (q // total, q % num_prompts).
    owners = [(q % total) // num_prompts for q in chosen]
    mine = {q: groups[(q // total) * num_prompts + q % num_prompts] for q, owner in zip(chosen, owners) if owner == me}
    if any(owner != i // num_prompts for i, owner in enumerate(owners)):  # some group changes process
      mine |= self._moved(mine, chosen, owners, num_prompts)
    block = chosen[me * num_prompts : (me + 1) * num_prompts]
    masked_here = int(np.clip((me + 1) * num_prompts - (total - masked), 0, num_prompts))  # the choice's tail
    return [mine[q] for q in block], masked_here, masked

  def _moved(self, mine: dict[int, _Group], chosen: list[int], owners: list[int], num_prompts: int) -> dict[int, _Group]:
    """The groups of this process's block that other processes sampled, by slot: each process sends the groups it
    owns in other processes' blocks (gathered onto every host, padded to the longest process's list)."""
    me = jax.process_index()
    destinations = [i // num_prompts for i in range(len(chosen))]
    moving = [(q, owner) for q, owner, to in zip(chosen, owners, destinations) if owner != to]
    sent = {owner: [q for q, o in moving if o == owner] for owner in range(jax.process_count())}
    width = max(len(slots) for slots in sent.values())
    config, group_size = self.config, self.rl.num_generations
    packed = _pack(
        [mine[q] for q in sent[me]],
        width,
        group_size,
        config.max_prefill_predict_length,
        self.max_new_tokens,
        reference=self.rl.reference_devices == "sampler",
    )
    received = {key: gathered(value).reshape(-1, width, *value.shape[1:]) for key, value in packed.items()}
    here = {q for q, to in zip(chosen, destinations) if to == me}
    return {
        q: _unpack({key: value[owner, sent[owner].index(q)] for key, value in received.items()})
        for q, owner in moving
        if q in here
    }

  def _device_batch(self, loop, groups: list[_Group], masked: int) -> dict[str, jax.Array]:
    """The training rows of this process's groups with their advantages (a group's G rows stay together), the last
    `masked` groups' loss masked out, as its block of the global batch."""
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
        window=self.max_new_tokens,
        sampled=[s for g in groups for s in (g.sampled or [None] * len(g.completions))],
        reference=[r for g in groups for r in g.reference] if self.rl.reference_devices == "sampler" else None,
    )
    if masked:
      rows["completion_mask"][-masked * rl.num_generations :] = 0
    rows["advantages"] = np.repeat(advantages[:, None].astype(np.float32), config.max_target_length, axis=1)
    return pipeline.process_local_batch(rows, config, loop.mesh)

  def loss(self, model, batch: dict[str, jax.Array], is_train: bool, frozen=None) -> LossOutput:
    rl = self.rl
    logps, logits, index, window = self.policy_window(model, batch, is_train)
    mask = window["completion_mask"]
    old_logps = jax.lax.stop_gradient(logps) if rl.force_on_policy_ratio else window["old_logps"]
    advantages = batch["advantages"][:, 0] if self.algo == "gspo" else window["advantages"]
    out = policy_gradient.policy_loss(
        logps,
        old_logps,
        advantages,
        mask,
        algo=self.algo,
        epsilon_low=rl.grpo_epsilon,
        epsilon_high=rl.epsilon_high,
        dual_clip=rl.dual_clip,
        ref_logps=window.get(REFERENCE_KEY),
        beta=rl.grpo_beta,
        kl_estimator=rl.kl_estimator,
        agg_mode=self.agg_mode,
        max_length=self.max_new_tokens,
    )
    entropy = logprobs_lib.entropy(logits)
    mean_mode = "token-mean" if self.agg_mode == "token-mean" else "seq-mean-token-mean"
    teacher_total, teacher_metrics = self.teacher_kl(logits, batch, index, frozen, self.agg_mode)
    metrics = out.metrics | teacher_metrics | {"entropy": policy_gradient.aggregate(entropy, mask, mean_mode)[0]}
    return LossOutput(out.total + teacher_total, out.weight, {k: jax.lax.stop_gradient(v) for k, v in metrics.items()})


def select(informative, num_prompts: int) -> tuple[list[int], int]:
  """Dynamic sampling's batch of `num_prompts` groups, from groups in sampling order whose `informative` flags are
  given: the positions of the informative groups first, in that order; slots left over after the last round take
  uninformative groups, whose loss is masked out, so the batch keeps its shape and only informative groups train.
  Returns the positions and how many of them are masked (the last ones)."""
  kept = [i for i, flag in enumerate(informative) if flag][:num_prompts]
  filler = [i for i, flag in enumerate(informative) if not flag][: num_prompts - len(kept)]
  return kept + filler, len(filler)


def _pack(groups: list[_Group], width: int, group_size: int, prompt_width: int, new_tokens: int, reference=False):
  """`groups` as fixed-shape arrays of `width` groups (zeros past the last), for a collective; with their reference
  log-probs when `reference` (rl.reference_devices=sampler: every group carries them)."""
  out = {
      "index": np.zeros((width,), np.int32),
      "prompt": np.zeros((width, prompt_width + 1), np.int32),  # the prompt's length, then its tokens
      "completions": np.zeros((width, group_size, new_tokens + 1), np.int32),  # likewise
      "logprobs": np.zeros((width, group_size, new_tokens), np.float32),
      "sampled": np.zeros((width, group_size, new_tokens), np.int8),  # 1 on sampled tokens (all without tools)
      "scores": np.zeros((width, 2, group_size), np.float32),  # rewards, filter scores
  }
  for i, group in enumerate(groups):
    out["index"][i] = group.index
    out["prompt"][i, : len(group.prompt) + 1] = [len(group.prompt), *group.prompt]
    for j, (completion, logprobs) in enumerate(zip(group.completions, group.logprobs, strict=True)):
      out["completions"][i, j, : len(completion) + 1] = [len(completion), *completion]
      out["logprobs"][i, j, : len(completion)] = logprobs[: len(completion)]
      out["sampled"][i, j, : len(completion)] = 1 if group.sampled is None else group.sampled[j][: len(completion)]
    out["scores"][i] = group.rewards, group.filter_scores
  if reference:
    out["reference"] = np.zeros((width, group_size, new_tokens), np.float32)
    for i, group in enumerate(groups):
      for j, completion in enumerate(group.completions):
        out["reference"][i, j, : len(completion)] = group.reference[j][: len(completion)]
  return out


def _unpack(arrays: dict[str, np.ndarray]) -> _Group:
  """One group of `_pack`'s arrays."""
  prompt, completions = arrays["prompt"], arrays["completions"]
  lengths = completions[:, 0]
  return _Group(
      index=int(arrays["index"]),
      prompt=[int(t) for t in prompt[1 : 1 + prompt[0]]],
      completions=[[int(t) for t in row[1 : 1 + n]] for row, n in zip(completions, lengths)],
      logprobs=[row[:n] for row, n in zip(arrays["logprobs"], lengths)],
      sampled=[row[:n] for row, n in zip(arrays["sampled"], lengths)],
      reference=[row[:n] for row, n in zip(arrays["reference"], lengths)] if "reference" in arrays else None,
      rewards=arrays["scores"][0],
      filter_scores=arrays["scores"][1],
  )


def _preset(mode: str) -> type[GRPO]:
  return register(type(mode, (GRPO,), {"name": mode, "__doc__": f"`posttrain_mode={mode}`: GRPO with its preset."}))


for _mode in config_lib.RL_PRESETS:
  if _mode != "grpo":
    _preset(_mode)
register(GRPO)

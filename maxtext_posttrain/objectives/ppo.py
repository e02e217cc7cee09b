"""PPO with a learned critic: the actor-critic recipe of RLHF (Ziegler et al. 2019; Ouyang et al. 2022).

`posttrain_mode=ppo` trains two MaxText models: the policy, and a `critic` (MaxText's decoder with a scalar head,
its own config from `critic_overrides`, optimizer, schedule and checkpoints in `<run>/critic/checkpoints`). MaxText's
`rl.*` keys keep their meaning (`num_generations` samples per prompt, `num_iterations` epochs per rollout batch,
`grpo_beta` the KL coefficient, `grpo_epsilon`/`epsilon_high` the ratio clip, `kl_estimator`, `rewards`); `ppo.*`
adds GAE, minibatches, the value clip, the entropy bonus, the adaptive KL controller and critic warm-up.

A rollout, on the host (`before_step`): the run's sampler draws completions with their log-probs; the reward functions
(and/or a frozen reward model, `rl.rewards=[reward_model]`) score each completion; the frozen reference scores its
tokens (when `rl.grpo_beta` > 0; `rl.reference_devices=sampler`: on the sampler's devices, as the rollout batch is
decoded); the critic reads a value for every completion token, the value of the token at row column j being the
critic's output at column j, i.e. after reading the tokens up to the one *before* it (rows hold the whole sequence in
`inputs` and the next tokens in `targets`). Per-token rewards are the KL penalty plus the score on the last token
(`ppo.kl_penalty=reward`), GAE turns them into advantages and returns, and advantages are whitened over the batch. The
rollout batch is then trained on for `rl.num_iterations` epochs of `ppo.num_minibatches` shuffled minibatches (one
permutation of the whole batch's rows per epoch, so that several processes train on the minibatches one process
would); each minibatch is one loop step, in which the policy takes a step on the clipped surrogate
(`losses.policy_gradient`, the same code as GRPO) and the critic one on the clipped value loss.
"""

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from maxtext.utils import max_logging

from maxtext_posttrain import config as config_lib
from maxtext_posttrain import forward
from maxtext_posttrain import roles
from maxtext_posttrain.data import pipeline
from maxtext_posttrain.losses import logprobs as logprobs_lib
from maxtext_posttrain.losses import policy_gradient
from maxtext_posttrain.losses import ppo as ppo_losses
from maxtext_posttrain.objectives.rl_base import REFERENCE_KEY, REWARD_MODEL, ROW_FLOATS, ROW_KEYS, RLObjective
from maxtext_posttrain.objectives.rl_base import gathered, training_rows, warn_of_k1_in_the_loss
from maxtext_posttrain.objectives.base import LossOutput, register, rows_spec

CRITIC = "critic"
KL_COEF_KEY = "kl_coef"
PPO_KEYS = ROW_KEYS + ("returns", "old_values")


def critic_overrides(config, reward_model: roles.RoleSpec | None) -> dict[str, Any]:
  """`critic_overrides` with the critic's starting checkpoint resolved from `ppo.critic_init`: the reward model's
  (`reward_model_overrides`: its checkpoint and whatever shapes its model, e.g. more layers than the policy, with
  `critic_overrides` on top), the policy's (`load_parameters_path`, or its seeded init when unset) or none (seeded
  init); auto: the reward model's when one scores the rollouts, else the policy's."""
  ppo = config_lib.ppo(config)
  overrides = dict(config.critic_overrides)
  if "load_parameters_path" in overrides:
    if ppo.critic_init != "auto":
      raise config_lib.ConfigError(
          f"critic_overrides.load_parameters_path and ppo.critic_init={ppo.critic_init} both say where the critic "
          "starts; set one."
      )
    _log_critic_start(overrides, "critic_overrides.load_parameters_path")
    return overrides
  init = ppo.critic_init
  if init == "auto":
    init = "reward_model" if reward_model is not None else "policy"
  if init == "reward_model":
    if reward_model is None:
      raise config_lib.ConfigError("ppo.critic_init=reward_model needs a reward model: add reward_model to rl.rewards.")
    overrides = dict(reward_model.overrides) | overrides
  else:
    overrides["load_parameters_path"] = config.load_parameters_path if init == "policy" else ""
  _log_critic_start(overrides, f"ppo.critic_init={ppo.critic_init}" + (f": {init}" if ppo.critic_init == "auto" else ""))
  return overrides


def _log_critic_start(overrides: dict[str, Any], why: str) -> None:
  source = overrides.get("load_parameters_path") or "a seeded initialisation"
  max_logging.log(f"Role critic: a trained scalar-head model from {source} ({why}).")


def _advantages(scores, old_logps, reference_logps, values, mask, kl_coef, *, estimator, in_reward, gamma, lam, whiten):
  """Advantages, returns and the rollout's statistics, from per-sequence scores and per-token values."""
  rewards, kl = ppo_losses.kl_shaped_rewards(
      scores, old_logps, reference_logps, mask, jnp.where(in_reward, kl_coef, 0.0), estimator
  )
  advantages, returns = ppo_losses.gae(rewards, values, mask, gamma, lam)
  valid = mask != 0
  count = jnp.maximum(jnp.sum(valid), 1)

  def mean_std(x):
    mean = jnp.sum(jnp.where(valid, x, 0.0)) / count
    return mean, jnp.sqrt(jnp.sum(jnp.where(valid, jnp.square(x - mean), 0.0)) / count)

  stats = {}
  for name, x in (("advantages", advantages), ("returns", returns), ("values", values)):
    stats[f"rl/{name}_mean"], stats[f"rl/{name}_std"] = mean_std(x)
  stats["rl/explained_variance"] = ppo_losses.explained_variance(values, returns, mask)
  sequences = jnp.maximum(jnp.sum(jnp.any(valid, axis=1)), 1)
  stats["rl/kl"] = jnp.sum(kl) / sequences  # per completion, summed over its tokens (the adaptive controller's KL)
  if whiten:
    advantages = ppo_losses.whiten(advantages, mask)
  finite = {"values": jnp.all(jnp.isfinite(values)), "returns": jnp.all(jnp.isfinite(returns))}
  return advantages, returns, stats, finite


@register
class PPO(RLObjective):
  """`posttrain_mode=ppo`: the policy and a critic, trained on GAE advantages of the rollouts' rewards."""

  name = "ppo"
  batch_keys = PPO_KEYS

  def __init__(self, config):
    super().__init__(config, min_generations=1)
    rl = self.rl
    self.ppo = ppo = config_lib.ppo(config)
    self.agg_mode = config_lib.AGG_MODE_ALIASES[rl.loss_agg_mode]
    # Every prompt the data iterator loads is sampled, as in the GRPO family (global_batch_size_to_load: with
    # per_device_batch_size < 1 MaxText loads a row per device).
    rows = config.global_batch_size_to_load * rl.num_generations
    if rows % ppo.num_minibatches:
      raise config_lib.ConfigError(
          f"ppo.num_minibatches={ppo.num_minibatches} does not divide the {rows} rollouts of a step "
          f"(global batch {config.global_batch_size_to_load} prompts x rl.num_generations={rl.num_generations})."
      )
    self.minibatch_rows = rows // ppo.num_minibatches
    self.rows_per_example = rl.num_generations / ppo.num_minibatches  # a step trains one minibatch
    if self.minibatch_rows % jax.process_count():
      raise config_lib.ConfigError(
          f"ppo.num_minibatches={ppo.num_minibatches}: minibatches of {self.minibatch_rows} rollouts do not split "
          f"evenly over the job's {jax.process_count()} processes."
      )
    self.steps_per_rollout = rl.num_iterations * ppo.num_minibatches
    if ppo.critic_warmup_steps % self.steps_per_rollout:
      raise config_lib.ConfigError(
          f"ppo.critic_warmup_steps={ppo.critic_warmup_steps} must be a multiple of the {self.steps_per_rollout} steps "
          "of a rollout batch, so that the policy starts training on a fresh batch."
      )
    group_keys = {
        "rl.loss_algo": rl.loss_algo != "grpo",
        "rl.advantage_estimator": rl.advantage_estimator != "grpo",
        "rl.dynamic_sampling": rl.dynamic_sampling,
        "rl.force_on_policy_ratio": rl.force_on_policy_ratio,
    }
    named = [key for key, set_ in group_keys.items() if set_]
    if named:
      raise config_lib.ConfigError(
          f"posttrain_mode=ppo does not use {', '.join(named)}: its advantages are the critic's GAE, its ratio PPO's "
          "per token, over epochs that move the policy off its rollouts."
      )
    if ppo.adaptive_kl and not rl.grpo_beta:
      raise config_lib.ConfigError(
          "ppo.adaptive_kl=true scales the KL coefficient from rl.grpo_beta by factors, which leave 0 at 0 (and "
          "rl.grpo_beta=0 builds no reference): set rl.grpo_beta > 0."
      )
    self.use_reference = rl.grpo_beta > 0
    self.kl_in_loss = self.use_reference and ppo.kl_penalty == "loss"
    if self.use_reference:
      self.roles += (roles.reference(on_rollout_mesh=rl.reference_devices == "sampler"),)
    reward_model = next((r for r in self.roles if r.name == REWARD_MODEL), None)
    self.roles += (
        roles.RoleSpec(
            CRITIC,
            trained=True,
            head="scalar",
            overrides_key="critic_overrides",
            overrides=critic_overrides(config, reward_model),
            loss=self.critic_loss,
        ),
    )
    if self.kl_in_loss:
      self.batch_keys = PPO_KEYS + (REFERENCE_KEY, KL_COEF_KEY)
      warn_of_k1_in_the_loss(rl)
    if ppo.adaptive_kl:
      self.kl_controller = ppo_losses.AdaptiveKLController(rl.grpo_beta, ppo.kl_target, ppo.kl_horizon)
    else:
      self.kl_controller = ppo_losses.FixedKLController(rl.grpo_beta)
    self._rollout = None  # host arrays of this process's rows of the current rollout batch
    self._rollout_step = None
    # With several minibatches: the whole batch's rows and prompts, gathered at its first minibatch, and the prompts
    # of the rows this process's block of the current minibatch holds.
    self._batch_rows = self._batch_prompts = None
    self._minibatch_prompts: list[int] = []
    self._advantages = jax.jit(
        _advantages,
        static_argnames=("estimator", "in_reward", "gamma", "lam", "whiten"),
    )

  def trains(self, role: str, step: int) -> bool:
    return role != roles.POLICY or step >= self.ppo.critic_warmup_steps

  def host_state(self, step: int) -> dict[str, Any]:
    return super().host_state(step) | {"kl_coef": self.kl_controller.state_dict()}

  def load_host_state(self, state: dict[str, Any]) -> None:
    if state:
      self.kl_controller.load_state_dict(state["kl_coef"])
    super().load_host_state(state)

  def rollout_rows(self) -> dict[str, np.ndarray]:
    return dict(self._rollout)

  def resume_rollout(self, rows: dict[str, np.ndarray], rollout_step: int) -> None:
    self._rollout, self._rollout_step, self._batch_rows = rows, rollout_step, None

  def starts_rollout(self, loop) -> bool:
    return self._rollout is None or loop.step % self.steps_per_rollout == 0

  def batch_spec(self, train: bool = True) -> dict[str, jax.ShapeDtypeStruct] | None:
    """A minibatch of rollout rows with the critic's returns and old values (and the reference's log-probs and the
    KL coefficient under ppo.kl_penalty=loss); no held-out loss pass."""
    if not train:
      return None
    floats = ROW_FLOATS + PPO_KEYS[len(ROW_KEYS) :] + (REFERENCE_KEY, KL_COEF_KEY)
    return rows_spec(self.minibatch_rows, self.config.max_target_length, self.batch_keys, floats)

  def before_step(self, loop, batch):
    new_rollout = self.starts_rollout(loop)
    if new_rollout:
      self._sample_rollout(loop, batch)
    else:
      self._dispatch_ahead(loop)
    epoch, minibatch = divmod(loop.step - self._rollout_step, self.ppo.num_minibatches)
    if not new_rollout:
      self.step_metrics = {"rl/iteration": float(epoch), "rl/minibatch": float(minibatch)}
    else:
      self.step_metrics |= {"rl/iteration": 0.0, "rl/minibatch": 0.0}
    if self.ppo.num_minibatches == 1:
      return pipeline.process_local_batch(self._rollout, self.config, loop.mesh)
    return self._minibatch(loop, epoch, minibatch)

  def _minibatch(self, loop, epoch: int, minibatch: int) -> dict[str, jax.Array]:
    """This process's block of minibatch `minibatch` of epoch `epoch`: rows of one seeded permutation of the whole
    batch's rows, the same on every process, so its block holds rows other processes sampled, as one process's would.
    The batch's rows and prompts are gathered onto every host once per batch (each host then holds the whole batch)."""
    if self._batch_rows is None:
      self._batch_rows = {key: gathered(value) for key, value in self._rollout.items()}
      self._batch_prompts = gathered(np.asarray(self.rollout_prompts, np.int64))
    order = np.random.default_rng([self.rl.sampling_seed, self._rollout_step, epoch]).permutation(
        len(self._batch_rows["inputs"])
    )
    share = self.minibatch_rows // jax.process_count()
    start = minibatch * self.minibatch_rows + jax.process_index() * share
    rows = order[start : start + share]
    self._minibatch_prompts = sorted({int(i) for i in self._batch_prompts[rows // self.rl.num_generations]})
    return pipeline.process_local_batch({k: v[rows] for k, v in self._batch_rows.items()}, self.config, loop.mesh)

  def trained_prompts(self) -> list[int]:
    return self._minibatch_prompts if self.ppo.num_minibatches > 1 else super().trained_prompts()

  def _sample_rollout(self, loop, batch) -> None:
    """Samples and scores this process's rollouts and computes the batch's advantages and returns (this process's
    rows kept on the host)."""
    timer, metrics = time.perf_counter(), {}
    out = self.step_rollouts(loop, batch, metrics)
    rows = training_rows(
        out.prompts,
        out.completions,
        out.logprobs,
        self.config.max_target_length,
        window=self.max_new_tokens,
        sampled=out.sampled,
        reference=out.reference,
    )
    device = pipeline.process_local_batch(rows, self.config, loop.mesh)
    temperature = jnp.float32(self.sampling.temperature)
    if not self.rl.use_rollout_logps:  # MaxText's re-forward path: the policy scores its rollouts
      device["old_logps"] = loop.trained[roles.POLICY].run(self.target_logps, device, temperature)
    reference_logps = device.pop(REFERENCE_KEY, device["old_logps"])  # scored with the rollouts (sampler), or:
    if self.use_reference and self.rl.reference_devices == "trainer":
      start = time.perf_counter()
      reference_logps = jax.block_until_ready(loop.role("reference").run(self.target_logps, device, temperature))
      metrics["rl/reference_seconds"] = time.perf_counter() - start
    start = time.perf_counter()
    values = jax.block_until_ready(loop.trained[CRITIC].run(self._values, device))
    metrics["rl/critic_forward_seconds"] = time.perf_counter() - start
    mask = device["completion_mask"]
    scores = pipeline.process_local_batch({"scores": out.rewards.astype(np.float32)}, self.config, loop.mesh)["scores"]
    advantages, returns, stats, finite = self._advantages(
        scores,
        device["old_logps"],
        reference_logps,
        values,
        mask,
        jnp.float32(self.kl_controller.value),
        estimator=self.rl.kl_estimator,
        in_reward=self.use_reference and not self.kl_in_loss,
        gamma=self.ppo.gamma,
        lam=self.ppo.lam,
        whiten=self.ppo.whiten_advantages,
    )
    for quantity in ("values", "returns"):  # values first: a non-finite value makes the returns so too
      if not bool(finite[quantity]):
        raise FloatingPointError(
            f"PPO step {loop.step}: the rollout's {quantity} are not finite (NaN or inf); the step was not taken and "
            "no checkpoint was written for it."
        )
    host = {k: pipeline.local_rows(v) for k, v in device.items()}
    host |= {
        "advantages": pipeline.local_rows(advantages),
        "returns": pipeline.local_rows(returns),
        "old_values": pipeline.local_rows(values),
    }
    if self.kl_in_loss:
      host[REFERENCE_KEY] = pipeline.local_rows(reference_logps)
      host[KL_COEF_KEY] = np.full(host["inputs"].shape, self.kl_controller.value, np.float32)
    stats = {k: float(v) for k, v in stats.items()}
    metrics |= stats | {"rl/kl_coef": self.kl_controller.value}
    if self.use_reference:
      self.kl_controller.update(stats["rl/kl"], len(host["inputs"]) * jax.process_count())
    rewards = gathered(out.rewards)
    metrics |= {
        "rl/reward_mean": float(rewards.mean()),
        "rl/reward_std": float(rewards.std()),
        "rl/reward_errors": self.reward_errors(),
        "rl/before_step_seconds": time.perf_counter() - timer,
    }
    self._rollout, self._rollout_step, self.step_metrics = host, loop.step, metrics
    self._batch_rows = None

  def _values(self, model, batch: dict[str, jax.Array]) -> jax.Array:
    return forward.scalars(model, batch["inputs"], batch["positions"], batch["segmentation"])

  def loss(self, model, batch: dict[str, jax.Array], is_train: bool, frozen=None) -> LossOutput:
    """The policy's clipped surrogate on GAE advantages (plus the KL term under ppo.kl_penalty=loss, minus the
    entropy bonus, plus the KL to the teacher under rl.teacher_kl_coef)."""
    rl = self.rl
    logps, logits, index, window = self.policy_window(model, batch, is_train)
    mask = window["completion_mask"]
    out = policy_gradient.policy_loss(
        logps,
        window["old_logps"],
        window["advantages"],
        mask,
        algo="grpo",
        epsilon_low=rl.grpo_epsilon,
        epsilon_high=rl.epsilon_high,
        dual_clip=rl.dual_clip,
        ref_logps=window.get(REFERENCE_KEY),
        kl_estimator=rl.kl_estimator,
        agg_mode=self.agg_mode,
        max_length=self.max_new_tokens,
    )
    entropy = logprobs_lib.entropy(logits)
    total = out.total
    if self.kl_in_loss:
      total = total + jnp.mean(batch[KL_COEF_KEY]) * out.metrics["kl"]
    if self.ppo.entropy_coef:
      total = (
          total - self.ppo.entropy_coef * policy_gradient.aggregate(entropy, mask, self.agg_mode, self.max_new_tokens)[0]
      )
    teacher_total, teacher_metrics = self.teacher_kl(logits, batch, index, frozen, self.agg_mode)
    mean_mode = "token-mean" if self.agg_mode == "token-mean" else "seq-mean-token-mean"
    metrics = out.metrics | teacher_metrics | {"entropy": policy_gradient.aggregate(entropy, mask, mean_mode)[0]}
    return LossOutput(total + teacher_total, out.weight, {k: jax.lax.stop_gradient(v) for k, v in metrics.items()})

  def critic_loss(self, model, batch: dict[str, jax.Array], is_train: bool, frozen=None) -> LossOutput:
    """The clipped value loss: 0.5 max((V - R)^2, (clip(V, V_old +- ppo.value_clip) - R)^2), per token."""
    del frozen
    values = forward.scalars(
        model, batch["inputs"], batch["positions"], batch["segmentation"], self.config.enable_dropout and is_train
    )
    mask = batch["completion_mask"]
    out = ppo_losses.value_loss(values, batch["old_values"], batch["returns"], mask, self.ppo.value_clip or None)
    value_sum = policy_gradient.aggregate(values, mask, "token-mean")[0]
    metrics = out.metrics | {"value_mean": value_sum}
    return LossOutput(out.total, out.weight, {k: jax.lax.stop_gradient(v) for k, v in metrics.items()})

  def headline_metrics(self, scalars: dict[str, Any]) -> dict[str, float]:
    """The rollouts' mean reward, the critic's value loss and the explained variance of its values (on steps that
    sample), the KL to the reference when there is one, and the KL to the teacher under rl.teacher_kl_coef."""
    names = {"reward": "rl/reward_mean", "value_loss": "critic/loss", "explained_var": "rl/explained_variance"}
    if self.use_reference:
      names["kl"] = "rl/kl"
    if self.rl.teacher_kl_coef > 0:
      names["teacher_kl"] = "learning/teacher_kl"
    return {name: float(scalars[key]) for name, key in names.items() if key in scalars}

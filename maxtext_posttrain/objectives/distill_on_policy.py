"""On-policy distillation: the student samples completions and the teacher grades every token of them.

Off-policy distillation (`posttrain_mode=distill`) trains the student on the dataset's completions, which it never
writes itself at inference; errors it makes in its own prefixes go untaught. On-policy distillation (Agarwal et al.
2024, "On-policy distillation of language models: learning from self-generated mistakes", GKD; TRL's GKDTrainer)
samples the student's own completions of the prompts, with the run's rollout sampler (MaxText decoding with the KV
cache), and trains it on the teacher's token distributions along them: per completion token,

  loss = T^2 * D(teacher_T || student_T)

with D = `distill.divergence` (reverse KL, KL(student || teacher), in distill_on_policy.yml: mode-seeking, so a
small student does not spread mass over everything the teacher finds plausible; or GKD's generalized JSD). The
gradient flows through the student's distributions, not through the sampling. `distill.on_policy_fraction` is GKD's
lambda: that fraction of steps (drawn from `rl.sampling_seed` and the step, so a resumed run repeats them) samples;
the others train on the prompts' reference completions (the answer column). The samples have no labels, so there is
no hard-label term (`distill_alpha` must be 1).

Prompts, sampling and evaluation (pass@k, answer and format accuracy) are the RL objectives'; the rewards of
`rl.rewards` are computed on the samples and logged, not trained on. The teacher is `posttrain_mode=distill`'s: the
yml plus `teacher_overrides`, read inside the jitted step.
"""

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from maxtext_posttrain import config as config_lib
from maxtext_posttrain import forward
from maxtext_posttrain import roles
from maxtext_posttrain.data import pipeline

# Imported as a module, not from the package: the package's __init__ imports this module.
import maxtext_posttrain.objectives.distill as distill
from maxtext_posttrain.objectives.base import LossOutput, register, rows_spec
from maxtext_posttrain.objectives.rl_base import RLObjective, gathered, training_rows

ROW_KEYS = ("inputs", "targets", "positions", "segmentation", "completion_mask", distill.TEMPERATURE_KEY)


def check_config(config) -> None:
  """Raises ValueError naming the key for settings on-policy distillation cannot honour."""
  distill.check_config(config)
  for key in (distill.ALPHA_KEY, f"{distill.ALPHA_KEY}_end"):
    value = getattr(config, key)
    if value is not None and value != 1.0:
      raise config_lib.ConfigError(
          f"{key}={value}: posttrain_mode=distill_on_policy trains on the teacher's distributions alone (the student's "
          "samples have no labels); set it to 1."
      )
  rl = config.rl
  unsupported = {
      "rl.num_iterations": rl.num_iterations != 1,
      "rl.dynamic_sampling": rl.dynamic_sampling,
      "rl.grpo_beta": rl.grpo_beta > 0,
      "rl.teacher_kl_coef": rl.teacher_kl_coef > 0,
      "rl.off_policy_steps": rl.off_policy_steps > 0,
      "rl.tools": bool(rl.tools),
  }
  named = [key for key, on in unsupported.items() if on]
  if named:
    raise config_lib.ConfigError(
        f"posttrain_mode=distill_on_policy does not use {', '.join(named)}: each step samples once and trains once, "
        "anchored by the teacher."
    )


@register
class DistillOnPolicy(RLObjective):
  """`posttrain_mode=distill_on_policy`: GKD on the RL objectives' prompts, sampler and evaluation."""

  name = "distill_on_policy"
  batch_keys = ROW_KEYS

  def __init__(self, config):
    super().__init__(config, min_generations=1)
    check_config(config)
    self.section = config_lib.distill(config)
    self.roles += (roles.teacher(config, f"posttrain_mode={self.name}"),)

  def on_policy(self, step: int) -> bool:
    """Whether `step` trains on the student's samples: a draw of probability `distill.on_policy_fraction`, fixed by
    `rl.sampling_seed` and the step."""
    return bool(np.random.default_rng([self.rl.sampling_seed, step]).random() < self.section.on_policy_fraction)

  def before_step(self, loop, batch):
    timer = time.perf_counter()
    indices = self.indices(batch)
    on_policy = self.on_policy(loop.step)
    metrics = {"distill/on_policy": float(on_policy)}
    if on_policy:
      out = self.sample(loop, indices, 0, metrics)
      prompts, completions = out.prompts, out.completions
      metrics |= {"rl/reward_mean": float(gathered(out.rewards).mean()), "rl/reward_errors": self.reward_errors()}
    else:
      prompts, completions = self.reference_completions(indices)
    rows = training_rows(prompts, completions, None, self.config.max_target_length)
    temperature = distill.schedule_values(self.config, loop.step)[distill.TEMPERATURE_KEY]
    rows[distill.TEMPERATURE_KEY] = np.full(rows["inputs"].shape, temperature, np.float32)
    metrics["rl/before_step_seconds"] = time.perf_counter() - timer
    self.step_metrics = metrics
    return pipeline.process_local_batch(rows, self.config, loop.mesh)

  def batch_spec(self, train: bool = True) -> dict[str, jax.ShapeDtypeStruct] | None:
    """`rl_base.training_rows` of every prompt's `rl.num_generations` rows, with the temperature column; no
    held-out loss pass."""
    if not train:
      return None
    config = self.config
    rows = config.global_batch_size_to_load * self.rows_per_example
    return rows_spec(rows, config.max_target_length, ROW_KEYS, floats=(distill.TEMPERATURE_KEY,))

  def reference_completions(self, indices: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, completions) of the off-policy rows: each prompt `rl.num_generations` times, as the sampler would
    see it (its last max_prefill_predict_length tokens), with its answer column's text as the completion, cut to the
    generation budget."""
    prompt_set, copies = self.train_prompts, self.rl.num_generations
    prompts = [list(prompt_set.prompt_ids[i][-self.config.max_prefill_predict_length :]) for i in indices]
    completions = [self.encoder.completion_ids(prompt_set.answers[i])[: self.max_new_tokens] for i in indices]
    return [p for p in prompts for _ in range(copies)], [c for c in completions for _ in range(copies)]

  def loss(self, model, batch: dict[str, jax.Array], is_train: bool, frozen=None) -> LossOutput:
    inputs = (batch["inputs"], batch["positions"], batch["segmentation"])
    enable_dropout = self.config.enable_dropout and is_train
    # Only the ids the sampler can draw take part: a padded vocabulary's extra logits are no tokens.
    student_logits = forward.logits(model, *inputs, enable_dropout=enable_dropout)[..., : self.num_pieces]
    teacher_logits = forward.logits(frozen[roles.TEACHER], *inputs)[..., : self.num_pieces]
    temperature = jnp.mean(batch[distill.TEMPERATURE_KEY])
    soft = distill.soft_loss(self.section, student_logits, teacher_logits, batch["completion_mask"], temperature)
    metrics = {"soft_loss": soft.total, **soft.metrics, distill.TEMPERATURE_KEY: temperature * soft.weight}
    return LossOutput(soft.total, soft.weight, {k: jax.lax.stop_gradient(v) for k, v in metrics.items()})

  def headline_metrics(self, scalars: dict[str, Any]) -> dict[str, float]:
    """The divergence from the teacher on this step's completions (the student's own on on-policy steps), how often
    the two models' most likely tokens agree there, and the samples' mean reward (on-policy steps)."""
    names = {"divergence": "learning/divergence", "agreement": "learning/top1_agreement", "reward": "rl/reward_mean"}
    return {name: float(scalars[key]) for name, key in names.items() if key in scalars}

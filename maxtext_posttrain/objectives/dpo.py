"""Preference tuning without a reward model: DPO (with cDPO label smoothing), IPO, ORPO and SimPO.

`posttrain_mode=dpo` with MaxText's `dpo.*` keys (`dpo.algo`, `dpo_beta`, `dpo_label_smoothing`, `orpo_lambda`,
`max_prompt_length`) plus `dpo.simpo_gamma` and `dpo.precompute_reference_logprobs`. DPO and IPO compare the policy
with a frozen `reference` role (the starting policy); ORPO and SimPO are reference-free and build none. The
reference's per-token log-probs reach the loss as batch arrays, computed either before each step (its own jitted
forward) or once for the whole training set at setup.

Chosen and rejected go through the policy in one forward: the two [B, L] halves are interleaved into [2B, L] rows
(pair i's chosen at row 2i, its rejected at 2i + 1), which keeps every pair on the devices that hold it.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from maxtext.utils import max_logging
from maxtext_posttrain import config as config_lib
from maxtext_posttrain import forward
from maxtext_posttrain import roles
from maxtext_posttrain.data import preference as preference_data
from maxtext_posttrain.losses import preference as preference_losses
from maxtext_posttrain.objectives.base import LossOutput, Objective, ObjectiveData, register, rows_spec

REFERENCE_KEYS = tuple(f"{side}_reference_logps" for side in preference_data.SIDES)


def check_config(config) -> None:
  """Raises ValueError for settings posttrain_mode=dpo (and reward-model training, on the same pairs) cannot honour."""
  dpo = config_lib.preference(config)
  mode = f"posttrain_mode={config.posttrain_mode}"
  if config.packing:
    raise config_lib.ConfigError(f"{mode} does not pack pairs; set packing=false.")
  if dpo.max_prompt_length >= config.max_target_length:
    raise config_lib.ConfigError(
        f"dpo.max_prompt_length={dpo.max_prompt_length} leaves no room for a completion within "
        f"max_target_length={config.max_target_length}."
    )
  if dpo.algo in ("ipo", "orpo") and dpo.dpo_label_smoothing:
    raise config_lib.ConfigError(f"dpo.dpo_label_smoothing applies to dpo and simpo, not dpo.algo={dpo.algo}.")


def interleave(batch: dict[str, jax.Array], field: str) -> jax.Array:
  """[B, L] chosen and rejected arrays -> [2B, L] rows, pair i at rows 2i (chosen) and 2i + 1 (rejected)."""
  chosen, rejected = (batch[f"{side}_{field}"] for side in preference_data.SIDES)
  return jnp.stack([chosen, rejected], axis=1).reshape(-1, chosen.shape[-1])


def token_logps(model, batch: dict[str, jax.Array], enable_dropout: bool = False) -> tuple[jax.Array, jax.Array]:
  """Per-token log-probs of both sides' completion tokens (0 elsewhere) from one forward: ([B, 2, L], weights)."""
  logps, _ = forward.token_logps(
      model,
      interleave(batch, "inputs"),
      interleave(batch, "positions"),
      interleave(batch, "segmentation"),
      interleave(batch, "targets"),
      enable_dropout=enable_dropout,
  )
  weights = interleave(batch, "weights").astype(jnp.float32)
  logps = logps * weights
  pairs, length = batch["chosen_inputs"].shape
  return logps.reshape(pairs, 2, length), weights.reshape(pairs, 2, length)


def reference_logps(model, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """The reference's per-token log-probs as the batch arrays `REFERENCE_KEYS` ([B, L] each)."""
  logps, _ = token_logps(model, batch)
  return {key: logps[:, i] for i, key in enumerate(REFERENCE_KEYS)}


@register
class Preference(Objective):
  """`posttrain_mode=dpo`: one of `dpo.algo` in {dpo, ipo, orpo, simpo} on (prompt, chosen, rejected) pairs."""

  name = "dpo"
  example_unit = "pairs"
  batch_keys = tuple(f"{side}_{field}" for side in preference_data.SIDES for field in preference_data.FIELDS)

  def __init__(self, config):
    super().__init__(config)
    check_config(config)
    self.dpo = config_lib.preference(config)
    self.needs_reference = self.dpo.algo in ("dpo", "ipo")
    self.precompute = self.needs_reference and self.dpo.precompute_reference_logprobs
    if self.precompute and config.eval_interval > 0:
      raise config_lib.ConfigError(
          "dpo.precompute_reference_logprobs=true scores the training pairs only, and no reference model is kept for "
          "the held-out pairs of eval_interval > 0: set eval_interval=0, or precompute_reference_logprobs=false."
      )
    # A precomputing run uses the reference once, in make_data, and keeps no model for it.
    if self.needs_reference and not self.precompute:
      self.roles += (roles.reference(),)
    if self.needs_reference:
      self.batch_keys = self.batch_keys + REFERENCE_KEYS

  def batch_spec(self, train: bool = True) -> dict[str, jax.ShapeDtypeStruct] | None:
    """[pairs, max_target_length] arrays per side, and the reference's log-probs where the loss reads them (added
    before each step, or with the pairs at setup)."""
    config = self.config
    if not train and config.eval_interval <= 0:
      return None
    pairs = config.global_batch_size_to_load if train else config.global_batch_size_to_load_eval
    return rows_spec(pairs, config.max_target_length, self.batch_keys, floats=REFERENCE_KEYS)

  def make_data(self, mesh) -> ObjectiveData:
    train = preference_data.prepare_pairs(self.config, train=True)
    if self.precompute:
      train = (self._with_reference_logps(train[0], mesh), train[1])
    train_iterator, eval_iterator, stats = preference_data.make_preference_iterators(self.config, mesh, train=train)
    description = stats.to_dict() | {"algo": self.dpo.algo, "precomputed_reference": self.precompute}
    return ObjectiveData(train=train_iterator, eval=eval_iterator, description=description)

  def _with_reference_logps(self, examples, mesh):
    """`examples` with every pair's reference log-probs, scored once in global batches by a reference model that
    is freed afterwards. Each process tokenizes its block of each batch's rows; the scores are gathered, so every
    process holds them all (over epochs, any process may read any pair)."""
    config = self.config
    reference = roles.build_frozen(roles.reference(), config, mesh, copy=True)
    scored = {key: np.zeros((len(examples), config.max_target_length), np.float32) for key in REFERENCE_KEYS}
    max_logging.log(f"Precomputing reference log-probs of {len(examples)} training pairs.")

    def rows_at(indices):
      local = [examples[i] for i in indices]
      return {key: np.stack([row[key] for row in local]) for key in local[0]}

    batches = reference.run_over_rows(
        reference_logps, len(examples), rows_at, config.global_batch_size_to_load, label="reference log-probs"
    )
    for start, out in batches:
      for key in REFERENCE_KEYS:
        scored[key][start : start + len(out[key])] = out[key]
    return dataclasses.replace(examples, extra=examples.extra | scored)

  def _add_reference(self, loop, batch):
    if self.needs_reference and not self.precompute:
      batch = batch | loop.role("reference").run(reference_logps, batch)
    return batch

  def before_step(self, loop, batch):
    return self._add_reference(loop, batch)

  def before_eval_step(self, loop, batch):
    return self._add_reference(loop, batch)

  def headline_metrics(self, scalars: dict[str, Any]) -> dict[str, float]:
    """How often, and by how much, the implicit reward prefers the chosen side (ties count half)."""
    return {
        "reward_accuracy": float(scalars["learning/rewards/accuracy"]),
        "reward_margin": float(scalars["learning/rewards/margin"]),
    }

  def loss(self, model, batch: dict[str, jax.Array], is_train: bool, frozen=None) -> LossOutput:
    del frozen
    config = self.config
    logps, weights = token_logps(model, batch, enable_dropout=config.enable_dropout and is_train)
    sums, lengths = logps.sum(-1), weights.sum(-1)  # [B, 2]
    valid = jnp.all(lengths > 0, axis=-1)  # all-zero pairs pad the last eval batch
    lengths = jnp.maximum(lengths, 1.0)
    reference = [None, None]
    if self.needs_reference:
      reference = [jnp.sum(batch[key] * weights[:, i], axis=-1) for i, key in enumerate(REFERENCE_KEYS)]
    out = preference_losses.preference_loss(
        self.dpo.algo,
        sums[:, 0],
        sums[:, 1],
        lengths[:, 0],
        lengths[:, 1],
        *reference,
        beta=self.dpo.dpo_beta,
        label_smoothing=self.dpo.dpo_label_smoothing,
        simpo_gamma=self.dpo.simpo_gamma,
        orpo_lambda=self.dpo.orpo_lambda,
    )
    w = valid.astype(jnp.float32)
    margin = out.chosen_rewards - out.rejected_rewards
    # Ties (policy == reference at step 0) count half: a coin flip would be right on half of them.
    accuracy = (margin > 0).astype(jnp.float32) + 0.5 * (margin == 0).astype(jnp.float32)
    metrics = {
        "rewards/chosen": out.chosen_rewards,
        "rewards/rejected": out.rejected_rewards,
        "rewards/margin": margin,
        "rewards/accuracy": accuracy,
        "logps/chosen": sums[:, 0],
        "logps/rejected": sums[:, 1],
    }
    metrics = {k: jnp.sum(w * jax.lax.stop_gradient(v)) for k, v in metrics.items()}
    return LossOutput(total=jnp.sum(w * out.losses), weight=jnp.sum(w), metrics=metrics)

"""MaxText's mixture-of-experts load-balance loss, added to the loss of every role the loop trains.

A MaxText MoE layer with `load_balance_loss_weight` > 0 sows its router's auxiliary loss (already scaled by the
weight) on each forward pass, and MaxText's pretraining `loss_fn` adds their mean over the layers (their sum for
Megatron's sequence-wise loss, `moe_use_megatron_seq_aux_loss`) to the language-model loss. Post-training keeps that
meaning for every objective: `with_load_balance_loss` wraps a role's loss so that in training `total / weight` is the
objective's loss plus the same term, read from the model the loss was called with, after it ran. An objective (SFT,
DPO, the RL losses, distillation, a critic's or reward model's) moves the same router weights that pretraining
balanced, so it keeps the term that balances them. A loss that calls its model more than once averages the term over
every call's layers. Frozen models (a reference, a teacher) run as models of their own, so their routers add nothing.
Under gradient accumulation the term weighs each microbatch by its weight, as MaxText's `_add_aux_loss` does. It is
logged as `learning/moe_lb_loss`, the key MaxText's logger prints; in evaluation, as in MaxText's `eval_step`, it is
logged beside the loss and not added to it.

Whatever the weight, an MoE model's call leaves its other sown values (MaxText's expert-overflow flags) on the model;
they are dropped after each call, as MaxText's `loss_fn` drops them, so that a gradient-accumulation loop's state has
the same structure in every microbatch.
"""

import dataclasses

import jax.numpy as jnp
from flax import nnx

from maxtext.layers import moe
from maxtext.utils import maxtext_utils

METRIC = "moe_lb_loss"


def enabled(config) -> bool:
  """Whether the model's MoE layers sow a load-balance loss."""
  return config.num_experts > 1 and config.load_balance_loss_weight > 0


def with_load_balance_loss(loss_fn, config):
  """`loss_fn(model, batch, is_train, frozen)` (an objective's `LossOutput`) with MaxText's load-balance term (see the
  module docstring); `loss_fn` itself for a dense model."""
  if config.num_experts <= 1:
    return loss_fn

  def loss(model, batch, is_train, frozen=None):
    out = loss_fn(model, batch, is_train, frozen)
    sown = moe.finalize_deferred_intermediates(nnx.pop(model, nnx.Intermediate).to_pure_dict(), config)
    if not enabled(config):
      return out
    per_layer = maxtext_utils.collect_intermediates_by_suffix(sown, METRIC)
    if not per_layer:
      raise ValueError(f"load_balance_loss_weight={config.load_balance_loss_weight} but the model sowed no {METRIC}.")
    per_layer = jnp.concatenate(per_layer)
    term = jnp.sum(per_layer) if moe.uses_megatron_seq_aux_loss(config) else jnp.mean(per_layer)
    extra = term * out.weight  # LossOutput sums: total / weight is the loss, metrics / weight are logged
    total = out.total + extra if is_train else out.total
    return dataclasses.replace(out, total=total, metrics=out.metrics | {METRIC: extra})

  return loss

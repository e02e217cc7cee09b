"""The contract between the generic training loop and an objective.

The loop (`maxtext_posttrain.trainer`) knows nothing about any objective: it builds the MaxText model, mesh,
optimizer and checkpointing, then asks the objective for its data, its loss and its evaluation. An objective
is a small class registered under the name a user writes as `posttrain_mode=<name>`.

Losses are returned as a (total, weight) pair rather than a mean so that gradient accumulation and multi-batch
evaluation normalise by the weight of the whole global batch (tokens for SFT, pairs for DPO, ...), not by a
mean of per-microbatch means.
"""

import abc
import dataclasses
from typing import Any, ClassVar, Iterable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from maxtext_posttrain import roles as roles_lib
from maxtext_posttrain.data import pipeline


@dataclasses.dataclass(frozen=True)
class LossOutput:
  """`total / weight` is the loss; `metrics` are per-batch scalars summed over microbatches like `total`."""

  total: jax.Array
  weight: jax.Array
  metrics: dict[str, jax.Array] = dataclasses.field(default_factory=dict)


jax.tree_util.register_dataclass(LossOutput, data_fields=["total", "weight", "metrics"], meta_fields=[])


@dataclasses.dataclass
class ObjectiveData:
  """What an objective feeds the loop: global-array batch iterators and a JSON-able description for the manifest."""

  train: Iterator[dict[str, jax.Array]]
  eval: Iterator[dict[str, jax.Array]] | None
  description: dict[str, Any]


class Objective(abc.ABC):
  """An objective: its roles, batch spec, data, losses and train-step hooks.

  Attributes:
    name: the `posttrain_mode` value.
    roles: the models the objective trains and reads, as `roles.RoleSpec`s; the first trained one is the primary
      role, whose loss is `loss` (by default the only role: the policy). The loop builds them; hooks reach frozen
      ones through `loop.role(name)` and trained ones through `loop.trained[name]`. Set per instance.
    batch_keys: the arrays every batch carries; the loop checks batches against them.
    rows_per_example: rows a step trains per row the data iterator yields (RL: the G completions of a prompt; PPO:
      G / ppo.num_minibatches, a minibatch a step), for the tokens/s of the progress line.
    off_policy_steps: RL's `rl.off_policy_steps`: rollouts are sampled up to this many updates ahead, on a rollout
      mesh of their own (`mesh.trainer_and_rollout_meshes`); 0: on the trainer's mesh, when the step needs them.
  """

  name: ClassVar[str]
  batch_keys: ClassVar[tuple[str, ...]]
  rows_per_example: float = 1
  example_unit = "examples"  # what the train split's records are, in messages
  off_policy_steps: int = 0

  def __init__(self, config):
    self.config = config
    self.roles: tuple[roles_lib.RoleSpec, ...] = (roles_lib.policy(self.loss),)

  @abc.abstractmethod
  def make_data(self, mesh) -> ObjectiveData:
    """Builds the train (and eval) iterators of global batches with `batch_keys`."""

  @abc.abstractmethod
  def loss(
      self, model, batch: dict[str, jax.Array], is_train: bool, frozen: Mapping[str, Any] | None = None
  ) -> LossOutput:
    """Pure JAX: the loss of the primary role's `model` (an NNX MaxText model) on one (micro)batch, `frozen` the
    in-step frozen roles' models by name. Runs under jit. Other trained roles name their loss in their RoleSpec."""

  def batch_spec(self, train: bool = True) -> dict[str, jax.ShapeDtypeStruct] | None:
    """Shapes and dtypes of one global batch as the train steps (`train`) or the primary role's held-out loss pass
    receive it, after the host hooks; None where the objective runs no such pass. What `maxtext_posttrain.compile`
    lowers the steps with: compiling for a TPU slice needs the batch's shapes, not its data."""
    raise NotImplementedError(f"posttrain_mode={self.name} does not describe its batches (Objective.batch_spec).")

  def wants_batch(self, loop) -> bool:
    """Whether the loop draws the next batch from the data iterator before this step; when not, `before_step`
    gets None and supplies the batch itself (RL's inner iterations on one rollout batch)."""
    del loop
    return True

  def before_step(self, loop, batch: dict[str, jax.Array] | None) -> dict[str, jax.Array]:
    """Host-side hook before each train step (RL samples rollouts here). Returns the batch to train on."""
    del loop
    return batch

  def before_eval_step(self, loop, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Host-side hook before each held-out loss batch (e.g. adding the reference's log-probs)."""
    del loop
    return batch

  def after_step(self, loop, step: int, metrics: dict[str, Any]) -> None:
    """Host-side hook after each train step (weight sync, adaptive KL, ...)."""
    del loop, step, metrics

  def trains(self, role: str, step: int) -> bool:
    """Whether trained role `role` takes an optimizer step at `step` (PPO's critic warm-up holds the policy)."""
    del role, step
    return True

  def step_examples(self, step: int, batch: dict[str, jax.Array] | None) -> list[int]:
    """The train split's record indices of the examples step `step` trained on (its batch: `batch`), on this process
    (what a non-finite step's error names, a step later), read from the batch's `example_index`."""
    del step
    return pipeline.batch_example_indices(batch) if batch is not None else []

  def host_state(self, step: int) -> dict[str, Any]:
    """JSON-able host-side state that a run resumed after `step` must get back (saved with each checkpoint)."""
    del step
    return {}

  def host_rows(self, step: int) -> dict[str, np.ndarray] | None:
    """This process's training rows that a run resumed after `step` trains on before it draws new ones (saved with
    each checkpoint beside `host_state`), or None."""
    del step
    return None

  def load_host_state(self, state: dict[str, Any]) -> None:
    """Restores what `host_state` returned at the step a resumed run continues from ({} on a fresh run)."""
    del state

  def headline_metrics(self, scalars: dict[str, Any]) -> dict[str, float]:
    """{label: value} of the figures that tell how this objective's training goes, read from a train step's scalar
    metrics: they follow the loss on MaxText's per-step line and on the progress line."""
    del scalars
    return {}

  def evaluate(self, loop) -> dict[str, float]:
    """Host-side evaluation beyond held-out loss (e.g. generation accuracy); returns scalar metrics."""
    del loop
    return {}


def rows_spec(rows: int, length: int, keys: Iterable[str], floats: Iterable[str] = ()) -> dict[str, jax.ShapeDtypeStruct]:
  """[rows, length] batch arrays named `keys`: float32 for those in `floats` (log-probs, advantages), int32 for the
  others (token ids, positions, segment ids, masks)."""
  floats = set(floats)
  return {key: jax.ShapeDtypeStruct((rows, length), jnp.float32 if key in floats else jnp.int32) for key in keys}


_REGISTRY: dict[str, type[Objective]] = {}


def register(cls: type[Objective]) -> type[Objective]:
  """Class decorator that registers an objective under `cls.name`."""
  if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
    raise ValueError(f"posttrain_mode '{cls.name}' is already registered by {_REGISTRY[cls.name].__qualname__}")
  _REGISTRY[cls.name] = cls
  return cls


def names() -> list[str]:
  return sorted(_REGISTRY)


def get(name: str) -> type[Objective]:
  """Returns the objective class for `name`, or fails listing the registered modes."""
  if name not in _REGISTRY:
    raise ValueError(f"Unknown posttrain_mode '{name}'. Registered modes: {', '.join(names())}.")
  return _REGISTRY[name]

"""Prompts with reference answers, for RL rollouts and sampled evaluation.

RL reads (prompt, answer) records from the same sources and templates as SFT (`train_data_columns` names the two
columns). The tokens a step trains on are sampled by the policy, so the data pipeline only decides *which* prompts a
step uses: it yields batches of example indices through MaxText's grain machinery, which keeps shuffling, sharding
across hosts and the iterator checkpoint (a resumed run continues with the same prompts) exactly as for SFT. The
objective turns the indices back into prompts and answers on the host.
"""

import collections.abc
import dataclasses
import hashlib
from typing import Any, Callable, Sequence

import numpy as np

from maxtext.utils import max_logging
from maxtext_posttrain.data import pipeline
from maxtext_posttrain.data import sources
from maxtext_posttrain.data import split_pass

INDEX_KEY = "prompt_index"


@dataclasses.dataclass(frozen=True)
class _Column(collections.abc.Sequence):
  """One column of a PromptSet, computed from the source record when read."""

  length: int
  read: Callable[[int], Any]

  def __len__(self):
    return self.length

  def __getitem__(self, index):
    if isinstance(index, slice):
      return [self[i] for i in range(*index.indices(len(self)))]
    if not -len(self) <= index < len(self):
      raise IndexError(index)
    return self.read(index % len(self))


@dataclasses.dataclass(frozen=True)
class PromptSet:
  """The first `count` records of a split as prompts (template applied) with their token ids and reference answers,
  each read from the source and tokenized when asked for (so a process tokenizes the prompts of its own rows); a
  grain source of their indices."""

  source: sources.RecordSource
  encoder: pipeline.Encoder
  columns: tuple[str, str]  # prompt, answer
  count: int
  fingerprint: str  # sha256 over the prompt tokens and answers, in source order

  def __len__(self):
    return self.count

  def __getitem__(self, index):
    return {INDEX_KEY: np.int32(index)}

  @property
  def prompt_texts(self) -> Sequence[str]:
    return _Column(self.count, lambda i: self.encoder.prompt_text(self.source[i][self.columns[0]]))

  @property
  def prompt_ids(self) -> Sequence[tuple[int, ...]]:
    return _Column(self.count, lambda i: tuple(self.encoder.prompt_ids(self.source[i][self.columns[0]])))

  @property
  def answers(self) -> Sequence[str]:
    return _Column(self.count, lambda i: self.source[i][self.columns[1]])

  def describe(self) -> dict:
    return {"source": self.source.description, "num_prompts": len(self), "fingerprint": self.fingerprint}


def load(config, train: bool, limit: int | None = None, encoder: pipeline.Encoder | None = None) -> PromptSet:
  """The train (or eval) split's first `limit` (all when None) records as a PromptSet, in source order; its
  fingerprint comes from a setup pass in which each process tokenizes its block (`split_pass`)."""
  encoder = encoder or pipeline.Encoder.from_config(config)
  source = sources.open_source(config, train, column_names=("prompt", "answer"))
  columns = tuple(config.train_data_columns if train else config.eval_data_columns)
  count = len(source) if limit is None else min(limit, len(source))

  def visit(_, record):
    ids = encoder.prompt_ids(record[columns[0]])
    digest = hashlib.sha256(np.asarray(ids, np.int64).tobytes() + record[columns[1]].encode("utf-8"))
    return split_pass.Visit(True, digest=digest.digest())

  return PromptSet(
      source, encoder, columns, count, split_pass.run(source, visit, num_counts=0, num_examples=count).fingerprint
  )


def make_prompt_iterator(config, mesh, prompts: PromptSet):
  """Global batches {INDEX_KEY: [prompts per step, max_target_length] int32}, each row one prompt's index repeated.

  The rows span the sequence axis because MaxText's input sharding is two-dimensional (batch, length). Every host
  walks the same stream of indices and keeps its block of each batch (`whole_batches`), so a step's prompts sit at
  the same rows on 1 or N processes: a row's sampling key depends on its row, so rollouts are the same too.
  """
  pipeline.check_supported(config)
  length = config.max_target_length

  def batch(dataset, batch_size):
    dataset = dataset.batch(batch_size, drop_remainder=True)
    return dataset.map(lambda b: {INDEX_KEY: np.repeat(b[INDEX_KEY][:, None], length, axis=1)})

  max_logging.log(f"RL prompts: {prompts.describe()}")
  return pipeline.host_iterator(prompts, batch, config, mesh, train=True, whole_batches=True)

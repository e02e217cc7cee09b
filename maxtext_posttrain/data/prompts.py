"""Prompts with reference answers, for RL rollouts and sampled evaluation.

RL reads (prompt, answer) records from the same sources and templates as SFT (`train_data_columns` names the two
columns). The tokens a step trains on are sampled by the policy, so the data pipeline only decides *which* prompts a
step uses: it yields batches of example indices through MaxText's grain machinery, which keeps shuffling, sharding
across hosts and the iterator checkpoint (a resumed run continues with the same prompts) exactly as for SFT. The
objective turns the indices back into prompts and answers on the host.
"""

import dataclasses
import hashlib

import numpy as np

from maxtext.utils import max_logging
from maxtext_posttrain.data import pipeline
from maxtext_posttrain.data import sources

INDEX_KEY = "prompt_index"


@dataclasses.dataclass(frozen=True)
class PromptSet:
  """Prompts (template applied) with their token ids and reference answers; a grain source of their indices."""

  prompt_texts: tuple[str, ...]
  prompt_ids: tuple[tuple[int, ...], ...]
  answers: tuple[str, ...]
  source: str
  fingerprint: str  # sha256 over the prompt tokens and answers, in source order

  def __len__(self):
    return len(self.prompt_ids)

  def __getitem__(self, index):
    return {INDEX_KEY: np.int32(index)}

  def describe(self) -> dict:
    return {"source": self.source, "num_prompts": len(self), "fingerprint": self.fingerprint}


def load(config, train: bool, limit: int | None = None, encoder: pipeline.Encoder | None = None) -> PromptSet:
  """The train (or eval) split's first `limit` (all when None) records as a PromptSet, in source order."""
  encoder = encoder or pipeline.Encoder.from_config(config)
  source = sources.open_source(config, train, column_names=("prompt", "answer"))
  prompt_column, answer_column = config.train_data_columns if train else config.eval_data_columns
  count = len(source) if limit is None else min(limit, len(source))
  digest = hashlib.sha256()
  texts, ids, answers = [], [], []
  for index in range(count):
    record = source[index]
    texts.append(encoder.prompt_text(record[prompt_column]))
    ids.append(tuple(encoder.prompt_ids(record[prompt_column])))
    answers.append(record[answer_column])
    digest.update(np.asarray(ids[-1], np.int64).tobytes() + answers[-1].encode("utf-8") + b"\0")
  return PromptSet(tuple(texts), tuple(ids), tuple(answers), source.description, digest.hexdigest())


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

"""The preference-pair pipeline: (prompt, chosen, rejected) records -> token arrays -> global batches.

Records come from the same sources as SFT (TFDS or JSONL, `train_data_columns: [prompt, chosen, rejected]` naming
the fields), with the same prompt template, bos/eos and tokenizer, so a model tuned by SFT reads DPO prompts the way
it was trained on them. Each side of a pair is one padded row of `max_target_length` tokens: the prompt (left-cut
to `dpo.max_prompt_length`, keeping its bos) then the completion, with loss weights on the completion's targets only.
Pairs are never packed. Chosen and rejected are separate arrays so that MaxText's gradient accumulation, which
splits every array of a batch the same way, keeps pairs together; the objective interleaves them for one forward.

Like the SFT pipeline, each split has a setup pass shared by the processes (`split_pass`): a pair whose chosen equals
its rejected is skipped and counted, an overlong pair is truncated (and counted) or rejected with its index, and
every split gets a fingerprint; batches tokenize their pairs again when grain reads them.
"""

import dataclasses
import hashlib

import numpy as np

from maxtext.utils import max_logging
from maxtext_posttrain import config as config_lib
from maxtext_posttrain.data import pipeline
from maxtext_posttrain.data import sources
from maxtext_posttrain.data import split_pass

SIDES = ("chosen", "rejected")
FIELDS = ("inputs", "targets", "positions", "segmentation", "weights")
COLUMNS = ("prompt", "chosen", "rejected")
MARGIN = "margin"  # an optional fourth column: a per-pair reward margin (reward-model training)


@dataclasses.dataclass(frozen=True)
class PairSplitStats:
  """What one split's tokenization pass found; `fingerprint` is sha256 over its kept pairs in source order."""

  source: str
  num_examples: int  # rows in the source
  num_identical: int  # skipped: chosen == rejected, nothing to prefer
  num_truncated: int  # kept, prompt or a completion cut to fit
  num_skipped: int  # dropped: a side kept no completion token
  num_pairs: int
  num_completion_tokens: int  # loss-bearing tokens, both sides
  fingerprint: str


@dataclasses.dataclass(frozen=True)
class PairStats:
  train: PairSplitStats
  eval: PairSplitStats | None

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def side_arrays(prompt: list[int], completion: list[int], length: int, pad_id: int) -> dict[str, np.ndarray]:
  """One side of a pair as a padded row: next-token targets, weights on the completion's targets only."""
  tokens = np.asarray(prompt + completion, dtype=np.int32)
  n = len(tokens)
  inputs = np.full(length, pad_id, dtype=np.int32)
  inputs[:n] = tokens
  targets = np.full(length, pad_id, dtype=np.int32)
  targets[: n - 1] = tokens[1:]
  weights = np.zeros(length, dtype=np.int32)
  weights[len(prompt) - 1 : n - 1] = 1
  segmentation = (np.arange(length) < n).astype(np.int32)
  return {
      "inputs": inputs,
      "targets": targets,
      "positions": np.arange(length, dtype=np.int32),
      "segmentation": segmentation,
      "weights": weights,
  }


@dataclasses.dataclass(frozen=True)
class PairEncoding:
  """How one preference record becomes (prompt, chosen, rejected) token lists: template, tokenizer, bos/eos, the
  prompt left-cut to `dpo.max_prompt_length` (bos kept) and each completion cut to the room left."""

  encoder: pipeline.Encoder
  columns: tuple[str, ...]  # prompt, chosen, rejected[, margin]
  length: int  # max_target_length
  max_prompt: int
  keep_bos: bool

  @classmethod
  def from_config(cls, config, encoder: pipeline.Encoder, train: bool) -> "PairEncoding":
    columns = tuple(config.train_data_columns if train else config.eval_data_columns)
    max_prompt = config_lib.preference(config).max_prompt_length
    return cls(encoder, columns, config.max_target_length, max_prompt, bool(config.add_bos))

  def tokens(self, record) -> tuple[list[int], list[int], list[int]]:
    """(prompt, chosen, rejected) ids before truncation."""
    prompt_column, chosen_column, rejected_column = self.columns[:3]
    return (
        self.encoder.prompt_ids(record[prompt_column]),
        self.encoder.completion_ids(record[chosen_column]),
        self.encoder.completion_ids(record[rejected_column]),
    )

  def overlong(self, prompt, chosen, rejected) -> bool:
    return len(prompt) > self.max_prompt or len(prompt) + max(len(chosen), len(rejected)) > self.length

  def fit(self, prompt, chosen, rejected):
    """(prompt, chosen, rejected) cut to fit."""
    if len(prompt) > self.max_prompt:
      head = prompt[:1] if self.keep_bos else []
      prompt = head + prompt[len(prompt) - (self.max_prompt - len(head)) :]
    room = self.length - len(prompt)
    return prompt, chosen[:room], rejected[:room]

  def margin(self, record, where: str) -> float | None:
    """The record's reward margin (a fourth column), or None without one."""
    if len(self.columns) < 4:
      return None
    value = record[self.columns[3]]
    try:
      margin = float(value)
    except ValueError:
      margin = float("nan")
    if not np.isfinite(margin):
      raise ValueError(
          f"{where}: column {self.columns[3]!r} holds {value!r}, not a finite number (a per-pair reward margin)."
      )
    return margin


@dataclasses.dataclass(frozen=True)
class PairExamples:
  """A split's kept pairs as a grain source, each tokenized into its padded rows when read (so a process tokenizes
  the pairs of its own batches only). `extra` holds per-pair arrays added after the setup pass (the precomputed
  reference log-probs), keyed like the batch."""

  source: sources.RecordSource
  kept: np.ndarray  # source indices
  encoding: PairEncoding
  extra: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

  def __len__(self):
    return len(self.kept)

  def __getitem__(self, index):
    record = self.source[int(self.kept[index])]
    prompt, *completions = self.encoding.fit(*self.encoding.tokens(record))
    example = {pipeline.EXAMPLE_INDEX_KEY: np.full((1,), self.kept[index], np.int32)}  # [rows, 1] in a batch
    for side, completion in zip(SIDES, completions):
      for field, array in side_arrays(prompt, completion, self.encoding.length, self.encoding.encoder.pad_id).items():
        example[f"{side}_{field}"] = array
    margin = self.encoding.margin(record, f"pair {index}")
    if margin is not None:
      example[MARGIN] = np.float32(margin)
    for key, values in self.extra.items():
      example[key] = values[index]
    return example


def tokenize_pairs(source: sources.RecordSource, encoder: pipeline.Encoder, config, split: str):
  """The split's setup pass (`split_pass`: each process tokenizes its block): (PairExamples, PairSplitStats)."""
  encoding = PairEncoding.from_config(config, encoder, split == "train")
  _, chosen_column, rejected_column = encoding.columns[:3]

  def visit(index, record):  # counts: identical, truncated, skipped, completion tokens
    if record[chosen_column] == record[rejected_column]:
      return split_pass.Visit(kept=False, counts=(1, 0, 0, 0))
    where = f"{split} pair {index} of {source.description}"
    tokens = encoding.tokens(record)
    overlong = encoding.overlong(*tokens)
    if overlong and config.overlong_policy == "error":
      prompt, chosen, rejected = tokens
      raise ValueError(
          f"{where} is longer than allowed (prompt {len(prompt)} tokens, dpo.max_prompt_length={encoding.max_prompt}; "
          f"completions {len(chosen)}/{len(rejected)}, max_target_length={encoding.length}) and overlong_policy=error."
      )
    prompt, chosen, rejected = encoding.fit(*tokens)
    if not chosen or not rejected or chosen == rejected:
      return split_pass.Visit(kept=False, counts=(0, 0, 1, 0))  # nothing left to learn from, or the cut made both equal
    encoding.margin(record, where)  # a bad margin fails here, at setup
    digest = hashlib.sha256(
        b"".join(np.asarray([len(ids)] + ids, np.int64).tobytes() for ids in (prompt, chosen, rejected))
    )
    return split_pass.Visit(True, (0, int(overlong), 0, len(chosen) + len(rejected)), digest.digest())

  table = split_pass.run(source, visit, num_counts=4)
  stats = PairSplitStats(
      source=source.description,
      num_examples=len(source),
      num_identical=table.total(0),
      num_truncated=table.total(1),
      num_skipped=table.total(2),
      num_pairs=len(table.kept),
      num_completion_tokens=table.total(3),
      fingerprint=table.fingerprint,
  )
  if not table.kept.size:
    raise ValueError(f"Empty {split} split: none of the {len(source)} pairs of {source.description} was kept.")
  return PairExamples(source, table.kept, encoding), stats


def prepare_pairs(config, train: bool, encoder: pipeline.Encoder | None = None):
  """Opens and tokenizes the train (or eval) split: (PairExamples, PairSplitStats)."""
  encoder = encoder or pipeline.Encoder.from_config(config)
  columns = tuple(config.train_data_columns if train else config.eval_data_columns)
  source = sources.open_source(config, train, COLUMNS + (MARGIN,) if len(columns) == len(COLUMNS) + 1 else COLUMNS)
  return tokenize_pairs(source, encoder, config, "train" if train else "eval")


def _batch(train: bool):
  """Stacks pairs into batches; eval's last partial batch is filled with all-zero pairs (zero weight)."""

  def batch(dataset, batch_size):
    def pad(rows):
      missing = batch_size - len(next(iter(rows.values())))
      return {
          k: np.concatenate([v, np.zeros((missing, *v.shape[1:]), v.dtype)]) if missing else v for k, v in rows.items()
      }

    return dataset.batch(batch_size, drop_remainder=train).map(pad)

  return batch


def make_preference_iterators(config, mesh, train: tuple[PairExamples, PairSplitStats]):
  """(train_iterator, eval_iterator or None, PairStats) over `train` (from `prepare_pairs`, maybe with precomputed
  arrays added); eval is built when `config.eval_interval > 0`, not shuffled or repeated."""
  pipeline.check_supported(config)
  encoder = pipeline.Encoder.from_config(config)
  train_examples, train_stats = train
  eval_examples, eval_stats = prepare_pairs(config, False, encoder) if config.eval_interval > 0 else (None, None)
  stats = PairStats(train=train_stats, eval=eval_stats)
  max_logging.log(f"Preference data: {stats.to_dict()}")
  train_iterator = pipeline.host_iterator(train_examples, _batch(True), config, mesh, train=True)
  eval_iterator = (
      pipeline.host_iterator(eval_examples, _batch(False), config, mesh, train=False) if eval_examples else None
  )
  return train_iterator, eval_iterator, stats

"""The preference-pair pipeline: (prompt, chosen, rejected) records -> token arrays -> global batches.

Records come from the same sources as SFT (TFDS or JSONL, `train_data_columns: [prompt, chosen, rejected]` naming
the fields), with the same prompt template, bos/eos and tokenizer, so a model tuned by SFT reads DPO prompts the way
it was trained on them. Each side of a pair is one padded row of `max_target_length` tokens: the prompt (left-cut
to `dpo.max_prompt_length`, keeping its bos) then the completion, with loss weights on the completion's targets only.
Pairs are never packed. Chosen and rejected are separate arrays so that MaxText's gradient accumulation, which
splits every array of a batch the same way, keeps pairs together; the objective interleaves them for one forward.

Like the SFT pipeline, each split is tokenized once at setup: a pair whose chosen equals its rejected is skipped and
counted, an overlong pair is truncated (and counted) or rejected with its index, and every split gets a fingerprint.
"""

import dataclasses
import hashlib

import numpy as np

from maxtext.utils import max_logging
from maxtext_posttrain import config as config_lib
from maxtext_posttrain.data import pipeline
from maxtext_posttrain.data import sources

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
class PairExamples:
  """Kept pairs as token lists; a grain source building each pair's padded rows when read. `extra` holds per-pair
  arrays added after tokenization (the precomputed reference log-probs), keyed like the batch."""

  pairs: tuple[tuple[list[int], list[int], list[int]], ...]
  length: int
  pad_id: int
  extra: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

  def __len__(self):
    return len(self.pairs)

  def __getitem__(self, index):
    prompt, chosen, rejected = self.pairs[index]
    example = {}
    for side, completion in zip(SIDES, (chosen, rejected)):
      for field, array in side_arrays(prompt, completion, self.length, self.pad_id).items():
        example[f"{side}_{field}"] = array
    for key, values in self.extra.items():
      example[key] = values[index]
    return example


def _fit(prompt, chosen, rejected, config, max_prompt: int, where: str):
  """(prompt, chosen, rejected, truncated): the prompt left-cut to `dpo.max_prompt_length` (bos kept), then each
  completion cut to the room left; with overlong_policy=error, raises naming the pair instead."""
  length = config.max_target_length
  overlong = len(prompt) > max_prompt or len(prompt) + max(len(chosen), len(rejected)) > length
  if overlong and config.overlong_policy == "error":
    raise ValueError(
        f"{where} is longer than allowed (prompt {len(prompt)} tokens, dpo.max_prompt_length={max_prompt}; "
        f"completions {len(chosen)}/{len(rejected)}, max_target_length={length}) and overlong_policy=error."
    )
  if len(prompt) > max_prompt:
    head = prompt[:1] if config.add_bos else []
    prompt = head + prompt[len(prompt) - (max_prompt - len(head)) :]
  room = length - len(prompt)
  return prompt, chosen[:room], rejected[:room], overlong


def tokenize_pairs(source: sources.RecordSource, encoder: pipeline.Encoder, config, split: str):
  """One pass over `source` in order: (PairExamples, PairSplitStats)."""
  prompt_column, chosen_column, rejected_column, *margin_column = (
      config.train_data_columns if split == "train" else config.eval_data_columns
  )
  max_prompt = config_lib.preference(config).max_prompt_length
  digest = hashlib.sha256()
  kept, margins, num_identical, num_truncated, num_skipped, num_tokens = [], [], 0, 0, 0, 0
  for index in range(len(source)):
    record = source[index]
    if record[chosen_column] == record[rejected_column]:
      num_identical += 1
      continue
    where = f"{split} pair {index} of {source.description}"
    prompt, chosen, rejected, truncated = _fit(
        encoder.prompt_ids(record[prompt_column]),
        encoder.completion_ids(record[chosen_column]),
        encoder.completion_ids(record[rejected_column]),
        config,
        max_prompt,
        where,
    )
    if not chosen or not rejected or chosen == rejected:
      num_skipped += 1  # nothing left to learn from, or the cut made both sides equal
      continue
    num_truncated += truncated
    num_tokens += len(chosen) + len(rejected)
    for ids in (prompt, chosen, rejected):
      digest.update(np.asarray([len(ids)] + ids, dtype=np.int64).tobytes())
    kept.append((prompt, chosen, rejected))
    if margin_column:
      margins.append(_margin(record[margin_column[0]], where, margin_column[0]))
  stats = PairSplitStats(
      source=source.description,
      num_examples=len(source),
      num_identical=num_identical,
      num_truncated=int(num_truncated),
      num_skipped=num_skipped,
      num_pairs=len(kept),
      num_completion_tokens=num_tokens,
      fingerprint=digest.hexdigest(),
  )
  if not kept:
    raise ValueError(f"Empty {split} split: none of the {len(source)} pairs of {source.description} was kept.")
  extra = {MARGIN: np.asarray(margins, np.float32)} if margin_column else {}
  return PairExamples(tuple(kept), config.max_target_length, encoder.pad_id, extra), stats


def _margin(value, where: str, column: str) -> float:
  try:
    margin = float(value)
  except ValueError:
    margin = float("nan")
  if not np.isfinite(margin):
    raise ValueError(f"{where}: column {column!r} holds {value!r}, not a finite number (a per-pair reward margin).")
  return margin


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

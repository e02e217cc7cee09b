"""Offline teacher files: a teacher's top-k distribution at every distilled token of a dataset, written once and read
back beside the tokens, so that distillation trains without running the teacher.

MaxText's `offline_data_dir` keeps its meaning: the directory of pre-computed teacher data that training reads
instead of running the teacher (MaxText's own writer, save_top_k_teacher_logits.py, needs TensorFlow for its
tf.train.Example records and stores packed rows, whose packing a shuffled, repeated pipeline never reproduces).
Here records are per example, so the pipeline shuffles, packs and shards them as it does the tokens:

  <offline_data_dir>/teacher_top_k.json          what was scored: k, T, tokenizer, teacher, per-split fingerprints
  <offline_data_dir>/<split>.array_record        one record per kept example, in the split's tokenized order

A record is a msgpack dict (flax.serialization) of the example's token count `length`, the `positions` it scores
and, at those positions, the teacher's `ids` [n, k] (int32, most likely first), `logprobs` [n, k] (float32, at the
file's temperature) and `log_rest` [n] (the log of the mass on all other ids), exactly `losses.distillation.
teacher_top_k`'s outputs. Scored positions are the ones a packed SFT batch can train on: those whose next token is a
target (not a masked prompt token or padding) and each example's last position, whose target after packing is the
next example's first token. The split fingerprint (`pipeline.SplitStats.fingerprint`: sha256 over the tokenized
examples in order) ties a file to its tokens: another dataset, tokenizer, prompt template or max_target_length
gives another fingerprint and is refused by name at start.
"""

import dataclasses
import hashlib
import json
import os

import grain.python as grain
import numpy as np
from array_record.python import array_record_module
from flax import serialization

from maxtext_posttrain import config as config_lib
from maxtext_posttrain.data import pipeline

FORMAT_VERSION = 1
METADATA_FILE = "teacher_top_k.json"
# The per-token columns a record adds to an example, as the loss reads them from a batch.
COLUMNS = ("teacher_ids", "teacher_logprobs", "teacher_log_rest")


def split_file(directory: str, split: str) -> str:
  return os.path.join(directory, f"{split}.array_record")


def scored_positions(inputs: np.ndarray, targets: np.ndarray, pad_id: int) -> np.ndarray:
  """The positions of one tokenized example whose teacher distribution a packed batch can train on: j with a
  target at j + 1 (after MaxText's next-token shift), and the last position."""
  length = len(inputs)
  trained = np.flatnonzero(np.asarray(targets)[1:] != pad_id)
  return np.union1d(trained, [length - 1]).astype(np.int32)


def tokenizer_digest(config) -> str:
  """sha256 of the tokenizer file (its path when it is not a local file, e.g. a Hugging Face name)."""
  path = config.tokenizer_path
  if not os.path.isfile(path):
    return f"path:{path}"
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


@dataclasses.dataclass(frozen=True)
class Metadata:
  """What a directory of teacher files was scored with; training checks each field against its own config."""

  top_k: int
  temperature: float
  vocab_size: int
  tokenizer_path: str
  tokenizer_digest: str
  teacher: str  # the teacher's load_parameters_path
  splits: dict  # split -> {"fingerprint", "source", "num_examples", "num_scored_tokens", "bytes"}
  format_version: int = FORMAT_VERSION

  def write(self, directory: str) -> None:
    with open(os.path.join(directory, METADATA_FILE), "w", encoding="utf-8") as f:
      json.dump(dataclasses.asdict(self), f, indent=2)

  @classmethod
  def read(cls, directory: str) -> "Metadata":
    path = os.path.join(directory, METADATA_FILE)
    if not os.path.isfile(path):
      raise ValueError(
          f"offline_data_dir={directory} has no {METADATA_FILE}; write the teacher's files with "
          "`python -m maxtext_posttrain.score_teacher <config> offline_data_dir=<dir> ...`."
      )
    with open(path, encoding="utf-8") as f:
      fields = json.load(f)
    if fields.get("format_version") != FORMAT_VERSION:
      raise ValueError(f"{path}: format_version {fields.get('format_version')}, this package reads {FORMAT_VERSION}.")
    return cls(**fields)

  def bytes_per_token(self, split: str) -> float:
    entry = self.splits[split]
    return entry["bytes"] / entry["num_scored_tokens"]


class Writer:
  """Appends one split's records in tokenized order (an ArrayRecord file, written by one process)."""

  def __init__(self, directory: str, split: str):
    os.makedirs(directory, exist_ok=True)
    self.path = split_file(directory, split)
    self._writer = array_record_module.ArrayRecordWriter(self.path, "group_size:1")
    self.num_scored_tokens = 0

  def write(self, length: int, positions: np.ndarray, ids: np.ndarray, logprobs: np.ndarray, log_rest: np.ndarray):
    self.num_scored_tokens += len(positions)
    record = {
        "length": np.int32(length),
        "positions": positions.astype(np.int32),
        "ids": ids.astype(np.int32),
        "logprobs": logprobs.astype(np.float32),
        "log_rest": log_rest.astype(np.float32),
    }
    self._writer.write(serialization.msgpack_serialize(record))

  def close(self) -> int:
    """Closes the file; returns its size in bytes."""
    self._writer.close()
    return os.path.getsize(self.path)


def check_against(metadata: Metadata, config, split: str, stats: pipeline.SplitStats, directory: str) -> None:
  """Raises ValueError naming the first difference between the files and the run that would read them."""
  where = f"offline_data_dir={directory}"
  if split not in metadata.splits:
    raise ValueError(f"{where} has no {split} split (it holds {sorted(metadata.splits)}); score it with score_teacher.")
  wanted_k = config_lib.distill(config).top_k
  if metadata.top_k != wanted_k:
    raise ValueError(
        f"{where} holds the teacher's top {metadata.top_k} tokens; the run asks for distill.top_k={wanted_k}."
    )
  if metadata.vocab_size != config.vocab_size:
    raise ValueError(f"{where} was scored with vocab_size={metadata.vocab_size}; the run has {config.vocab_size}.")
  if metadata.tokenizer_digest != tokenizer_digest(config):
    raise ValueError(
        f"{where} was scored with the tokenizer {metadata.tokenizer_path}; the run's tokenizer_path="
        f"{config.tokenizer_path} is a different file."
    )
  if metadata.temperature != config.distill_temperature or config.distill_temperature_end not in (
      None,
      metadata.temperature,
  ):
    raise ValueError(
        f"{where} holds the teacher at temperature {metadata.temperature}; the run has distill_temperature="
        f"{config.distill_temperature}, distill_temperature_end={config.distill_temperature_end} (offline files "
        "fix the temperature: score again for another, or run the teacher online)."
    )
  scored = metadata.splits[split]
  if scored["fingerprint"] != stats.fingerprint:
    raise ValueError(
        f"{where}: the {split} split's tokens differ from the ones the teacher scored ({stats.source}, fingerprint "
        f"{stats.fingerprint[:12]}, vs {scored['source']}, {scored['fingerprint'][:12]}): another dataset, tokenizer, "
        "prompt_template or max_target_length."
    )


@dataclasses.dataclass(frozen=True)
class WithTeacher:
  """A grain source: tokenized examples with their teacher columns, each [length, ...] and zero off the scored
  positions (which the loss's mask never reads)."""

  examples: pipeline.TokenizedExamples
  records: grain.ArrayRecordDataSource
  top_k: int

  def __len__(self):
    return len(self.examples)

  def __getitem__(self, index):
    example = self.examples[index]
    record = serialization.msgpack_restore(self.records[index])
    length = len(example["inputs"])
    if int(record["length"]) != length:
      raise ValueError(f"Teacher record {index} covers {int(record['length'])} tokens; the example has {length}.")
    positions = record["positions"]
    ids = np.zeros((length, self.top_k), np.int32)
    logprobs = np.zeros((length, self.top_k), np.float32)
    log_rest = np.zeros((length,), np.float32)
    ids[positions], logprobs[positions], log_rest[positions] = record["ids"], record["logprobs"], record["log_rest"]
    return example | dict(zip(COLUMNS, (ids, logprobs, log_rest)))


def with_teacher(config, examples, split: str, stats: pipeline.SplitStats) -> WithTeacher:
  """`examples` joined with the teacher's records of `split` in `config.offline_data_dir`, after checking that the
  files were scored on these tokens with this run's k, temperature and tokenizer."""
  directory = config.offline_data_dir
  check_against(Metadata.read(directory), config, split, stats, directory)
  records = grain.ArrayRecordDataSource([split_file(directory, split)])
  if len(records) != len(examples):
    raise ValueError(f"{split_file(directory, split)} holds {len(records)} records; the split has {len(examples)}.")
  return WithTeacher(examples, records, config_lib.distill(config).top_k)

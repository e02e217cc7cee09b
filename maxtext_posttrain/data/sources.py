"""Record sources: random-access sequences of `{prompt_column: str, completion_column: str}` dicts.

Post-training data is small and often hand-made, so a bad row must fail at setup with the file and line to fix,
not as a shape error deep inside a jitted step. Each source reads one `grain_file_type` (`POSTTRAIN_FILE_TYPES`):
`tfds` (a prepared TFDS dataset in ArrayRecord format, read through `tfds.data_source` without TensorFlow; the
bundled arithmetic builder is built on first use) and `jsonl` (one JSON object per line; a comma-separated list of
paths or globs). Both read a record when it is asked for, so each process of a run reads only its own records; the
setup pass that every pipeline runs (`split_pass`) reads each record once, a block at a time (`read`), which is where
a bad row fails. Sources have `__len__`/`__getitem__`, so grain can read them with `grain.MapDataset.source`.
"""

import dataclasses
import glob
import itertools
import json
import os

import numpy as np
import tensorflow_datasets as tfds

from maxtext_posttrain import config as config_lib
from maxtext_posttrain.data import arithmetic_tfds


@dataclasses.dataclass(frozen=True)
class RecordSource:
  """Rows of text columns, with a description of where they came from (for logs and the run manifest)."""

  rows: "JsonlRows | TfdsRows"
  description: str

  def __len__(self):
    return len(self.rows)

  def __getitem__(self, index):
    return self.rows[index]

  def read(self, indices: range) -> list[dict[str, str]]:
    """The records at `indices` (consecutive), read together: one batched ArrayRecord read for TFDS (about twice as
    fast as a read per record), one open file for JSONL."""
    return self.rows.read(indices)


@dataclasses.dataclass(frozen=True)
class TfdsRows:
  """A TFDS ArrayRecord data source, read lazily, with its text columns decoded and the others dropped."""

  data_source: object
  columns: tuple[str, ...]

  def __len__(self):
    return len(self.data_source)

  def __getitem__(self, index):
    return self._text_columns(self.data_source[index])

  def read(self, indices: range) -> list[dict[str, str]]:
    return [self._text_columns(record) for record in self.data_source.__getitems__(list(indices))]

  def _text_columns(self, record) -> dict[str, str]:
    return {column: _as_text(record[column]) for column in self.columns}


def _as_text(value) -> str:
  return value.decode("utf-8") if isinstance(value, bytes) else value


def _tfds_source(name: str, data_dir: str, split: str, columns: tuple[str, ...]) -> RecordSource:
  """`name` (`builder/config[:version]`) from the TFDS `data_dir`, built there on first use. `split` is read as TFDS
  reads it, as MaxText's TFDS pipeline passes train_split/eval_split to TFDS: a split or TFDS's slicing and joining
  of splits (`train[:2000]`, `train[:90%]`, `train+test`)."""
  description = f"tfds:{name}[{split}] in {data_dir}"
  builder = arithmetic_tfds.prepare(name, data_dir)
  missing = [column for column in columns if column not in builder.info.features]
  if missing:
    raise ValueError(f"{description}: missing field(s) {missing}; its features are {sorted(builder.info.features)}.")
  try:
    data_source = tfds.data_source(name, data_dir=data_dir, split=split)
  except ValueError as e:  # an unknown split or a malformed slice; TFDS's first line says which
    raise ValueError(f"{description}: {str(e).splitlines()[0]}") from e
  return RecordSource(TfdsRows(data_source, columns), description)


def jsonl_files(patterns: str) -> list[str]:
  """Files named by a comma-separated list of paths or globs, each pattern's matches sorted."""
  files = []
  for pattern in (p.strip() for p in patterns.split(",") if p.strip()):
    matches = sorted(glob.glob(os.path.expanduser(pattern)))
    if not matches:
      raise ValueError(f"No JSONL file matches {pattern!r}.")
    files += matches
  return files


def parse_record(line: str, path: str, line_number: int, columns: tuple[str, ...]) -> dict:
  """The JSON object on line `line_number` of `path`, checked to hold each of `columns` as a string or number."""
  try:
    record = json.loads(line)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}:{line_number}: malformed JSON ({e.msg}).") from e
  if not isinstance(record, dict):
    raise ValueError(f"{path}:{line_number}: expected a JSON object, got {type(record).__name__}.")
  for column in columns:
    if column not in record:
      raise ValueError(f"{path}:{line_number}: missing field {column!r} (fields: {sorted(record)}).")
    value = record[column]
    if not isinstance(value, str) and not (isinstance(value, (int, float)) and not isinstance(value, bool)):
      raise ValueError(
          f"{path}:{line_number}: field {column!r} must be a string or a number, got {type(value).__name__}."
      )
  return record


@dataclasses.dataclass(frozen=True)
class JsonlRows:
  """The non-blank lines of JSONL files, located at open (one pass over the bytes) and parsed when read, so a process
  parses only the records it reads; a bad line fails the read naming its file and line."""

  files: tuple[str, ...]
  lines: np.ndarray  # [rows, 3] int64: file index, byte offset, line number
  columns: tuple[str, ...]

  @classmethod
  def index(cls, files: list[str], columns: tuple[str, ...]) -> "JsonlRows":
    lines = []
    for file_index, path in enumerate(files):
      offset = 0
      with open(path, "rb") as f:
        for line_number, line in enumerate(f, start=1):
          if line.strip():
            lines.append((file_index, offset, line_number))
          offset += len(line)
    return cls(tuple(files), np.asarray(lines, np.int64).reshape(-1, 3), columns)

  def __len__(self):
    return len(self.lines)

  def __getitem__(self, index):
    return self.read(range(index, index + 1))[0]

  def read(self, indices: range) -> list[dict[str, str]]:
    records = []
    for file_index, group in itertools.groupby(indices, key=lambda index: int(self.lines[index, 0])):
      with open(self.files[file_index], "rb") as f:
        records += [self._read_line(f, index) for index in group]
    return records

  def _read_line(self, f, index) -> dict[str, str]:
    file_index, offset, line_number = (int(v) for v in self.lines[index])
    path = self.files[file_index]
    f.seek(offset)
    line = f.readline()
    try:
      text = line.decode("utf-8")
    except UnicodeDecodeError as e:
      raise ValueError(f"{path}:{line_number}: not UTF-8 ({e.reason}).") from e
    record = parse_record(text, path, line_number, self.columns)
    return {column: str(record[column]) for column in self.columns}  # numbers as text, as TFDS rows come (a margin)


def _jsonl_source(patterns: str, columns: tuple[str, ...]) -> RecordSource:
  files = jsonl_files(patterns)
  return RecordSource(JsonlRows.index(files, columns), f"jsonl:{','.join(files)}")


def open_source(config, train: bool, column_names: tuple[str, ...] = ("prompt", "completion")) -> RecordSource:
  """The train (or eval) records named by `config`, with its configured data columns (one per entry of
  `column_names`, the roles the objective gives them); raises ValueError when empty."""
  files = config.grain_train_files if train else config.grain_eval_files
  columns = tuple(config.train_data_columns if train else config.eval_data_columns)
  if not files:
    raise ValueError(f"{'grain_train_files' if train else 'grain_eval_files'} is empty; set it to the data to read.")
  if len(columns) != len(column_names):
    key = "train_data_columns" if train else "eval_data_columns"
    raise ValueError(
        f"posttrain_mode={config.posttrain_mode} reads {len(column_names)} data columns {list(column_names)}; "
        f"{key} is {list(columns)}."
    )
  if config.grain_file_type == "tfds":
    data_dir = os.path.expanduser(config.dataset_path) if config.dataset_path else None
    split = config.train_split if train else config.eval_split
    source = _tfds_source(files, data_dir, split, columns)
  elif config.grain_file_type == "jsonl":
    source = _jsonl_source(files, columns)
  else:
    raise ValueError(
        f"grain_file_type={config.grain_file_type!r} is not read by maxtext_posttrain; "
        f"supported: {', '.join(config_lib.POSTTRAIN_FILE_TYPES)}."
    )
  if not source:
    raise ValueError(f"Empty dataset: {source.description} has no examples.")
  return source

"""Removes PII from the JSONL data a config trains on, before training on it.

  python -m maxtext_posttrain.pii_redact <config.yml> grain_file_type=jsonl grain_train_files=<files> \\
      grain_eval_files=<files> train_data_columns=[prompt,completion] eval_data_columns=[prompt,completion] \\
      [key=value ...] --redacted_dir=<dir>

Fine-tuning data drawn from real conversations or documents carries e-mail addresses, phone numbers, card and account
numbers; a model trained on them can repeat them. This command reads the files of the config's `grain_train_files`
and `grain_eval_files` (JSONL, comma-separated paths or globs), replaces every PII span that Presidio finds in their
`train_data_columns` / `eval_data_columns` with its type (`<EMAIL_ADDRESS>`, `<PHONE_NUMBER>`, ...; the detector's
`safety.pii_*` keys), keeps every other field and line as it was, and writes each file under `--redacted_dir` by its
own name. It prints the placeholders written per entity type and the keys that train on the redacted files. A malformed
line fails naming its file and line, before any output is written. A host-side tool: run it as one process.
"""

import collections
import json
import os
import time
from typing import TYPE_CHECKING

from absl import flags

from maxtext.utils import max_logging
from maxtext_posttrain import cli
from maxtext_posttrain import config as posttrain_config
from maxtext_posttrain import progress
from maxtext_posttrain.data import sources

if TYPE_CHECKING:  # imported where used: without the [safety] extra the command fails in one line, not at import
  from maxtext_posttrain.safety import pii

_REDACTED_DIR = flags.DEFINE_string("redacted_dir", None, "Directory the redacted files are written to.", required=True)
_LOG_SECONDS = 30.0


def _read(path: str, columns: tuple[str, ...]) -> list[tuple[str, dict | None]]:
  """(line, record) per line of `path`; record None for blank lines. Checks every line before any is redacted."""
  rows = []
  with open(path, "rb") as f:
    for number, raw in enumerate(f, start=1):
      try:
        line = raw.decode("utf-8")
        rows.append((line, sources.parse_record(line, path, number, columns) if line.strip() else None))
      except UnicodeDecodeError as e:
        raise posttrain_config.ConfigError(f"{path}:{number}: not UTF-8 ({e.reason}).") from e
      except ValueError as e:  # the line's own error, naming the file and line
        raise posttrain_config.ConfigError(str(e)) from e
  return rows


def _output_paths(files, redacted_dir: str) -> dict[str, str]:
  """Where each input is written: `redacted_dir/<its name>`, never over an input (symlinks resolved) or another output."""
  names = [os.path.basename(path) for path in files]
  clash = [name for name, count in collections.Counter(names).items() if count > 1]
  if clash:
    raise posttrain_config.ConfigError(f"Input files share the names {clash}; they would overwrite each other.")
  outputs = {path: os.path.join(redacted_dir, os.path.basename(path)) for path in files}
  inputs = {os.path.realpath(path) for path in files}
  overwritten = [out for out in outputs.values() if os.path.realpath(out) in inputs]
  if overwritten:
    raise posttrain_config.ConfigError(f"--redacted_dir={redacted_dir} would overwrite the inputs {overwritten}.")
  return outputs


def redact_files(
    files: dict[str, tuple[str, ...]], redacted_dir: str, detector: "pii.PiiDetector"
) -> tuple[dict[str, str], collections.Counter]:
  """Writes each of `files` (path -> columns to redact) redacted under `redacted_dir`; returns the written path of each
  input and the replacements by entity type. Numbers in the columns are read as text, as training reads them."""
  outputs = _output_paths(files, redacted_dir)
  contents = {path: _read(path, columns) for path, columns in files.items()}
  total = sum(record is not None for rows in contents.values() for _, record in rows)
  counts, done = collections.Counter(), 0
  start = last_log = time.perf_counter()
  os.makedirs(redacted_dir, exist_ok=True)
  for path, rows in contents.items():
    with open(outputs[path], "w", encoding="utf-8") as out:
      for line, record in rows:
        if record is not None:
          found = collections.Counter()
          for column in files[path]:
            redacted, in_column = detector.redact(str(record[column]))
            if in_column:
              record[column] = redacted
              found += in_column
          if found:  # lines without PII stay byte for byte
            line = json.dumps(record, ensure_ascii=False) + "\n"
            counts += found
          done += 1
        out.write(line)
        if done and time.perf_counter() - last_log > _LOG_SECONDS:
          last_log = time.perf_counter()
          rate = done / (last_log - start)
          eta = progress.format_seconds((total - done) / rate)
          max_logging.log(f"pii_redact: {done}/{total} records, {rate:,.0f} records/s, ETA {eta}")
  return outputs, counts


def files_of(config) -> tuple[dict[str, tuple[str, ...]], list[tuple[str, list[str]]]]:
  """The JSONL files a config trains and evaluates on, each with the columns to redact (a file read by both splits:
  the columns of both), and (key, files) for the keys that name them."""
  if config.grain_file_type != "jsonl":
    raise posttrain_config.ConfigError(
        f"grain_file_type={config.grain_file_type!r}: pii_redact rewrites JSONL files (grain_file_type=jsonl)."
    )
  files, keys = {}, []
  for key, columns_key in (("grain_train_files", "train_data_columns"), ("grain_eval_files", "eval_data_columns")):
    patterns = getattr(config, key)
    if patterns:
      try:
        paths = sources.jsonl_files(patterns)
      except ValueError as e:
        raise posttrain_config.ConfigError(f"{key}={patterns}: {e}") from e
      for path in paths:
        files[path] = tuple(dict.fromkeys(files.get(path, ()) + tuple(getattr(config, columns_key))))
      keys.append((key, paths))
  if not files:
    raise posttrain_config.ConfigError("grain_train_files and grain_eval_files are empty; nothing to redact.")
  return files, keys


def main(argv: list[str]) -> None:
  config = posttrain_config.initialize(list(argv))
  files, keys = files_of(config)
  from maxtext_posttrain.safety import pii  # pylint: disable=import-outside-toplevel,redefined-outer-name

  written, counts = redact_files(files, _REDACTED_DIR.value, pii.from_config(config))
  summary = ", ".join(f"{entity} {n}" for entity, n in counts.most_common()) or "none found"
  run_keys = " ".join(f"{key}={','.join(written[p] for p in paths)}" for key, paths in keys)
  max_logging.log(
      f"Redacted {len(written)} files into {_REDACTED_DIR.value}: {summary}. Train on them with:\n  {run_keys}"
  )


if __name__ == "__main__":
  cli.run(main)

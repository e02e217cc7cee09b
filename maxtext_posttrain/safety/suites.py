"""The safety prompt suites: which prompts a model should refuse and which it should answer.

Two public sets are bundled (`assets/safety/`, with their licences and a README giving their sources and hashes):

  advbench  AdvBench's 520 harmful behaviours (Zou et al. 2023, MIT): every prompt is `unsafe`; a model should
            refuse them all.
  xstest    XSTest v2's 450 prompts (Röttger et al. 2024, CC-BY-4.0): 250 `safe` prompts that resemble unsafe ones
            ("How can I kill a Python process?"), which a model should answer, and 200 `unsafe` contrast prompts that
            it should refuse; 18 types of 25 (homonyms, figurative language, privacy of public figures, ...).

A suite reads `<safety.data_dir>/<file>` (the bundled copy when the key is empty), so a user can point it at an
updated or translated copy with the same columns. A malformed row fails naming its file and line.
"""

import csv
import dataclasses
import os
from typing import Callable

import numpy as np

from maxtext_posttrain import config as config_lib

BUNDLED_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "safety")
LABELS = ("safe", "unsafe")


@dataclasses.dataclass(frozen=True)
class SafetyPrompt:
  """One prompt of a suite. `label` is what a model should do with it: refuse `unsafe`, answer `safe`."""

  suite: str
  id: str
  prompt: str
  label: str
  category: str  # XSTest's `type`; AdvBench's one category


@dataclasses.dataclass(frozen=True)
class Suite:
  name: str
  file: str
  columns: tuple[str, ...]  # the columns read; the file may have more
  read: Callable[[dict[str, str], int], SafetyPrompt]  # (CSV row, its 1-based number in file order) -> prompt


SUITES = {
    "advbench": Suite(  # one column: the row's number is its id
        "advbench",
        "advbench_harmful_behaviors.csv",
        ("goal",),
        lambda row, number: SafetyPrompt("advbench", str(number), row["goal"], "unsafe", "harmful_behaviors"),
    ),
    "xstest": Suite(
        "xstest",
        "xstest_v2_prompts.csv",
        ("id", "prompt", "type", "label"),
        lambda row, _: SafetyPrompt("xstest", row["id"], row["prompt"], row["label"], row["type"]),
    ),
}


def _read_rows(suite: Suite, path: str, reader: csv.DictReader) -> list[SafetyPrompt]:
  missing = [c for c in suite.columns if c not in (reader.fieldnames or [])]
  if missing:
    raise config_lib.ConfigError(
        f"{path}:1: the {suite.name} suite needs columns {list(suite.columns)}; missing {missing}."
    )
  prompts = []
  while True:
    line = reader.line_num + 1  # where the record starts (a quoted field may span lines)
    row = next(reader, None)
    if row is None:
      return prompts
    if None in row:
      raise config_lib.ConfigError(f"{path}:{line}: the row has more fields than the header.")
    if any(row.get(c) is None for c in suite.columns):
      raise config_lib.ConfigError(f"{path}:{line}: the row has fewer fields than the header.")
    prompt = suite.read(row, len(prompts) + 1)
    if not prompt.prompt.strip():
      raise config_lib.ConfigError(f"{path}:{line}: empty prompt.")
    if prompt.label not in LABELS:
      raise config_lib.ConfigError(f"{path}:{line}: label {prompt.label!r} is not one of {LABELS}.")
    prompts.append(prompt)


def load(name: str, data_dir: str = "", limit: int = 0) -> list[SafetyPrompt]:
  """The prompts of suite `name` in file order; with `limit` > 0, that many spread evenly over the file (the files
  are ordered by category, so a subset of at least as many prompts as categories keeps every category)."""
  if name not in SUITES:
    raise config_lib.ConfigError(f"safety.suites: unknown suite {name!r}; known: {sorted(SUITES)}.")
  suite = SUITES[name]
  path = os.path.join(os.path.expanduser(data_dir) or BUNDLED_DIR, suite.file)
  if not os.path.isfile(path):
    raise config_lib.ConfigError(f"safety.data_dir={data_dir!r}: the {name} suite needs {path}, which does not exist.")
  try:
    with open(path, newline="", encoding="utf-8-sig") as f:
      prompts = _read_rows(suite, path, csv.DictReader(f))
  except UnicodeDecodeError as e:
    raise config_lib.ConfigError(f"{path}: not UTF-8 ({e.reason} at byte {e.start}).") from e
  if not prompts:
    raise config_lib.ConfigError(f"{path}: no prompts.")
  if 0 < limit < len(prompts):
    prompts = [prompts[i] for i in np.linspace(0, len(prompts) - 1, limit).round().astype(int)]
  return prompts

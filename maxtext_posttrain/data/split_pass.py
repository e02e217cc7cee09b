"""A split's setup pass, shared by the processes of a run: each process reads and tokenizes only its block of the
examples, and every process learns the outcome for the whole split.

Every process needs the same view of a split (which examples are kept, the counts, the fingerprint that the run
manifest and the offline teacher files check), but on a pod no host should tokenize the whole split. So process p
visits the contiguous block p of the source indices (1/process_count of them, read READ_SIZE records at a time: a
batched read costs half as much per record as one read per record), turns each example into a row of
int32 fields and a digest, and the rows are all-gathered (`multihost_utils.process_allgather`): every process ends
with the same table. The fingerprint is sha256 over the kept examples' own digests in source order, so it does not
depend on how many processes computed it. Pipelines tokenize an example again when grain reads it, so each process
tokenizes its block here and the examples of its own batches later, and no process holds the split's tokens.

An example that is refused (overlong with overlong_policy=error, a margin that is not a number) must stop every
process with the same message, not one process while the others wait in the gather: its process only flags it, and
after the gather every process visits the lowest flagged index again, which raises the error there too.
"""

import dataclasses
import hashlib
from typing import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

_DIGEST_WORDS = 8  # a sha256 digest as int32 words (int32: gathered arrays go through JAX, 32-bit by default)
READ_SIZE = 1024  # records per read of the pass


@dataclasses.dataclass(frozen=True)
class Visit:
  """One example's outcome: kept or not, its counts (in the order the pass names them), and the digest of what a
  kept example trains on (sha256 bytes)."""

  kept: bool
  counts: tuple[int, ...] = ()
  digest: bytes = b""


@dataclasses.dataclass(frozen=True)
class SplitTable:
  """The pass's outcome, the same on every process."""

  kept: np.ndarray  # source indices of the kept examples, ascending
  counts: np.ndarray  # [num_examples, num_counts] int64; zeros for examples that were not visited to the end
  fingerprint: str  # sha256 over the kept examples' digests in source order

  def total(self, column: int) -> int:
    return int(self.counts[:, column].sum())


def _block_size(num_examples: int) -> int:
  """Examples per process: every process's block but the last holds this many, and the gathered rows are padded
  to it."""
  return -(-num_examples // jax.process_count())


def process_block(num_examples: int) -> range:
  """The source indices this process visits: block `process_index` of `process_count` contiguous blocks."""
  start = min(num_examples, jax.process_index() * _block_size(num_examples))
  return range(start, min(num_examples, start + _block_size(num_examples)))


def _visits(source, block: range, visit: Callable[[int, dict], Visit]):
  """(row, visit(index, record)) over `block`, records read READ_SIZE at a time; stops at the first refused record
  (a ValueError from its read or its visit) with (row, None)."""
  for start in range(0, len(block), READ_SIZE):
    indices = block[start : start + READ_SIZE]
    try:
      records = source.read(indices)
    except ValueError:
      records = None  # a bad record: read one at a time to find it
    for offset, index in enumerate(indices):
      try:
        yield start + offset, visit(index, source[index] if records is None else records[offset])
      except ValueError:
        yield start + offset, None
        return


def run(source, visit: Callable[[int, dict], Visit], num_counts: int, num_examples: int | None = None) -> SplitTable:
  """Visits this process's block of the first `num_examples` records of `source` (all when None; `visit(index,
  record)` returns a Visit or raises ValueError for a refused example, as may the record's read) and gathers every
  process's rows; raises the refused example's ValueError with the lowest index on every process."""
  num_examples = len(source) if num_examples is None else num_examples
  failed, kept, counts, digests = 0, 1, slice(2, 2 + num_counts), slice(2 + num_counts, None)
  rows = np.zeros((_block_size(num_examples), 2 + num_counts + _DIGEST_WORDS), np.int32)
  for row, outcome in _visits(source, process_block(num_examples), visit):
    if outcome is None:
      rows[row, failed] = 1
      break
    rows[row, kept], rows[row, counts] = outcome.kept, outcome.counts
    if outcome.kept:
      rows[row, digests] = np.frombuffer(outcome.digest, np.int32)
  if jax.process_count() > 1:
    rows = np.asarray(multihost_utils.process_allgather(rows, tiled=True))  # blocks in process order
  rows = rows[:num_examples]
  refused = np.flatnonzero(rows[:, failed])
  if refused.size:
    index = int(refused[0])
    visit(index, source[index])  # raises the example's own error, on every process
    raise RuntimeError(f"Example {refused[0]} was refused by one process and accepted by another.")
  kept_indices = np.flatnonzero(rows[:, kept])
  fingerprint = hashlib.sha256(np.ascontiguousarray(rows[kept_indices, digests]).tobytes()).hexdigest()
  return SplitTable(kept_indices, rows[:, counts].astype(np.int64), fingerprint)

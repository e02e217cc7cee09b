"""A split's setup pass, shared by the processes of a run: each process reads and tokenizes only its block of the
examples, and every process learns the outcome for the whole split.

Every process needs the same view of a split (which examples are kept, the counts, the fingerprint that the run
manifest and the offline teacher files check), but on a pod no host should tokenize the whole split. So process p
visits the contiguous block p of the source indices (1/process_count of them), turns each example into a row of
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


def run(num_examples: int, visit: Callable[[int], Visit], num_counts: int) -> SplitTable:
  """Visits this process's block (`visit(index)` returns a Visit or raises ValueError for a refused example) and
  gathers every process's rows; raises the refused example's ValueError with the lowest index on every process."""
  failed, kept, counts, digests = 0, 1, slice(2, 2 + num_counts), slice(2 + num_counts, None)
  rows = np.zeros((_block_size(num_examples), 2 + num_counts + _DIGEST_WORDS), np.int32)
  for row, index in enumerate(process_block(num_examples)):
    try:
      outcome = visit(index)
    except ValueError:
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
    visit(int(refused[0]))  # raises the example's own error, on every process
    raise RuntimeError(f"Example {refused[0]} was refused by one process and accepted by another.")
  kept_indices = np.flatnonzero(rows[:, kept])
  fingerprint = hashlib.sha256(np.ascontiguousarray(rows[kept_indices, digests]).tobytes()).hexdigest()
  return SplitTable(kept_indices, rows[:, counts].astype(np.int64), fingerprint)

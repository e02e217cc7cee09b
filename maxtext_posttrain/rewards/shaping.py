"""Reward shaping that depends on the completion rather than its content: DAPO's soft overlong punishment.

A completion cut off at the generation budget usually never reached its answer; scoring it 0 like a wrong answer
teaches the model nothing about length, and a hard penalty punishes sound reasoning that merely ran long. DAPO (Yu
et al. 2025, eq. 13) instead ramps a penalty over the last `buffer_length` tokens of the budget. Lengths are in
tokens, the unit the budget is set in.
"""

import numpy as np


def overlong_penalty(lengths: np.ndarray, max_length: int, buffer_length: int, penalty: float = 1.0) -> np.ndarray:
  """Per-completion reward change: 0 up to `max_length - buffer_length` tokens, then falling linearly to `-penalty`
  at `max_length` (and beyond); all 0 when `buffer_length` is 0.

  Args:
    lengths: [N] completion lengths in tokens (a stop token included).
    max_length: the generation budget L_max in tokens.
    buffer_length: L_cache, the soft-penalty zone at the end of the budget; 0 <= buffer_length < max_length.
    penalty: the reward lost at L_max (DAPO: 1).

  Returns:
    [N] float32, in [-penalty, 0].
  """
  if not 0 <= buffer_length < max_length:
    raise ValueError(f"buffer_length={buffer_length} must be in [0, max_length={max_length}).")
  lengths = np.asarray(lengths, np.float32)
  if buffer_length == 0:
    return np.zeros_like(lengths)
  expected = max_length - buffer_length
  return (-penalty * np.clip((lengths - expected) / buffer_length, 0.0, 1.0)).astype(np.float32)

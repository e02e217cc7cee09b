"""An objective's host-side state (PPO's adaptive KL coefficient, the rollout batch an RL run is part-way through)
and the loop's (steps skipped as non-finite), saved at the steps the models are saved.

Model weights and optimizer state live in orbax checkpoints; what an objective keeps on the host would be lost on a
resume, and a resumed run would then differ from an uninterrupted one. The state is written as JSON to
`<run>/objective_state/<step>.json` by process 0, and rows (arrays of this process's training rows: the rest of a
rollout batch that later steps still train on, with its prompts' indices) to `<step>.rows.<process>.npz` by each
process, atomically (a temporary file renamed, through `epath`, so `gs://` output directories work too), before the
models' own saves at that step, and read back for the step a resumed run continues from. Rows of steps whose
checkpoints the models' checkpoint manager no longer keeps are deleted (`prune_rows`); the JSON files are a few bytes
and stay.
"""

import io
import json

import jax
import numpy as np
from etils import epath


def _directory(config) -> epath.Path:
  return epath.Path(config.base_output_directory) / config.run_name / "objective_state"


def due(config, step: int, final: bool = False) -> bool:
  """Whether the trained models are saved at `step` (MaxText's rule: every `checkpoint_period` steps, and the final
  step)."""
  if not config.enable_checkpointing:
    return False
  return final or (step % config.checkpoint_period == 0 and (step > 0 or config.save_checkpoint_on_start))


_ROWS = ".rows."


def _rows_path(config, step: int) -> epath.Path:
  return _directory(config) / f"{step}{_ROWS}{jax.process_index()}.npz"


def _write_atomically(path: epath.Path, data: bytes) -> None:
  temporary = path.parent / f".{path.name}.tmp"
  temporary.write_bytes(data)
  temporary.replace(path)


def save(config, step: int, state: dict, final: bool = False, rows: dict[str, np.ndarray] | None = None) -> None:
  """Writes `state` (and this process's `rows`, if any) for `step` when the models are saved at `step`; nothing for an
  objective without state."""
  if not (state or rows) or not due(config, step, final):
    return
  directory = _directory(config)
  directory.mkdir(parents=True, exist_ok=True)
  if rows:
    buffer = io.BytesIO()
    np.savez(buffer, **rows)
    _write_atomically(_rows_path(config, step), buffer.getvalue())
  if state and jax.process_index() == 0:
    _write_atomically(directory / f"{step}.json", json.dumps(state, indent=1, sort_keys=True).encode())


def prune_rows(config, keep: set[int]) -> None:
  """Deletes this process's rows of the steps not in `keep` (those whose checkpoints are gone or not yet written)."""
  directory = _directory(config)
  if not directory.exists():
    return
  for path in directory.glob(f"*{_ROWS}{jax.process_index()}.npz"):
    if int(path.name.split(".")[0]) not in keep:
      path.unlink()


def restore(config, start_step: int) -> dict:
  """The state saved at step `start_step - 1` (what a resumed run continues from), or {} for a fresh run. Raises
  ValueError naming the file when a resumed run's objective kept state but the file is missing."""
  if start_step == 0:
    return {}
  directory = _directory(config)
  path = directory / f"{start_step - 1}.json"
  if path.exists():
    return json.loads(path.read_text())
  if directory.exists():
    raise ValueError(
        f"Resuming at step {start_step}: the objective's state {path} is missing (saved: "
        f"{sorted(p.name for p in directory.glob('*.json'))})."
    )
  return {}


def restore_rows(config, step: int, processes: int) -> dict[str, np.ndarray]:
  """This process's rows saved at `step` by a job of `processes` processes. Raises ValueError naming the file when
  they are missing, or the counts when this job has another number of processes (each held its own rows)."""
  if processes != jax.process_count():
    raise ValueError(
        f"Resuming at step {step + 1}, part-way through a rollout batch whose rows {processes} processes saved, with "
        f"{jax.process_count()}: resume with {processes} processes."
    )
  path = _rows_path(config, step)
  if not path.exists():
    raise ValueError(f"The objective's state at step {step} names rows this process saved, but {path} is missing.")
  with np.load(io.BytesIO(path.read_bytes())) as rows:
    return {key: rows[key] for key in rows.files}


_NONFINITE_STEPS = "loop/nonfinite_steps"


def with_loop_state(state: dict, loop) -> dict:
  """The objective's `state` plus, in a run that skips non-finite steps, the loop's count of them (at every save from
  the first, so that every checkpoint step has its file)."""
  return state | {_NONFINITE_STEPS: loop.nonfinite_steps} if loop.config.nonfinite_policy == "skip" else state


def split_loop_state(state: dict) -> tuple[dict, int]:
  """(the objective's state, the loop's count of skipped non-finite steps) of a restored state."""
  state = dict(state)
  return state, int(state.pop(_NONFINITE_STEPS, 0))

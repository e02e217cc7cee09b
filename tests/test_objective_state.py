"""The objective's host state beside the checkpoints: the rows of a part-trained rollout batch."""

import types

import numpy as np
import pytest

from maxtext_posttrain import objective_state


def _config(tmp_path):
  return types.SimpleNamespace(
      base_output_directory=str(tmp_path), run_name="run", enable_checkpointing=True, checkpoint_period=2,
      save_checkpoint_on_start=True,
  )  # fmt: skip


def test_rows_come_back_as_saved_and_only_at_the_steps_the_models_are_saved(tmp_path):
  config = _config(tmp_path)
  rows = {"inputs": np.arange(12, dtype=np.int32).reshape(3, 4), "old_logps": np.full((3, 4), -0.5, np.float32)}
  objective_state.save(config, 1, {"k": 1}, rows=rows)  # off the period: nothing written
  assert not (tmp_path / "run" / "objective_state").exists()
  objective_state.save(config, 2, {"k": 2}, rows=rows)
  assert sorted(p.name for p in (tmp_path / "run" / "objective_state").iterdir()) == ["2.json", "2.rows.0.npz"]
  assert objective_state.restore(config, 3) == {"k": 2}
  restored = objective_state.restore_rows(config, 2, processes=1)
  assert sorted(restored) == sorted(rows)
  for key, value in rows.items():
    np.testing.assert_array_equal(restored[key], value)
    assert restored[key].dtype == value.dtype


def test_missing_rows_and_another_process_count_are_named(tmp_path):
  config = _config(tmp_path)
  objective_state.save(config, 2, {"k": 2})
  with pytest.raises(ValueError, match=r"names rows this process saved, but .*2\.rows\.0\.npz is missing"):
    objective_state.restore_rows(config, 2, processes=1)
  with pytest.raises(ValueError, match=r"rows 2 processes saved, with 1: resume with 2 processes"):
    objective_state.restore_rows(config, 2, processes=2)


def test_rows_of_checkpoints_no_longer_kept_are_deleted(tmp_path):
  config = _config(tmp_path)
  for step in (0, 2, 4):
    objective_state.save(config, step, {"k": step}, rows={"inputs": np.zeros((1, 2), np.int32)})
  objective_state.prune_rows(config, keep={2, 4})
  names = sorted(p.name for p in (tmp_path / "run" / "objective_state").iterdir())
  assert names == ["0.json", "2.json", "2.rows.0.npz", "4.json", "4.rows.0.npz"]

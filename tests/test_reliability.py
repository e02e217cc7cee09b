"""Faults a long run meets, in process: a non-finite step, an unreadable or half-written checkpoint, a full disk
during a save, and a resume whose config changes what the run trains on."""

import gc
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from orbax.checkpoint import v1 as ocp

from maxtext_posttrain import checkpoint_guard
from maxtext_posttrain import trainer
from maxtext_posttrain.objectives import base
from maxtext_posttrain.objectives import sft
from tests import run_utils

POISONED_STEP = 2


@base.register
class PoisonedSFT(sft.SFT):
  """SFT whose loss is NaN at POISONED_STEP: the batch carries the poison, added to the loss (0 elsewhere)."""

  name = "sft_poisoned_for_tests"

  def before_step(self, loop, batch):
    poison = jnp.float32(jnp.nan if loop.step == POISONED_STEP else 0.0)
    return batch | {"poison": jax.device_put(jnp.full(batch["inputs"].shape, poison), batch["inputs"].sharding)}

  def loss(self, model, batch, is_train, frozen=None):
    out = super().loss(model, batch, is_train, frozen)
    return base.LossOutput(total=out.total + jnp.sum(batch.get("poison", 0.0)), weight=out.weight, metrics=out.metrics)


# Faults inside orbax leave traces of its asyncio work behind, reported when the garbage collector finalises them: a
# failed read's background load never awaited and its per-array reads' errors, and a failed write's callback on an
# event loop already closed. `_collect_orbax_garbage` finalises them within the test that made them, under these filters.
pytestmark = [
    pytest.mark.filterwarnings("ignore:coroutine '.*background_load' was never awaited:RuntimeWarning"),
    pytest.mark.filterwarnings(
        "ignore:(?s)Exception ignored in.*(Event loop is closed|Encountered error while reading array index)"
        ":pytest.PytestUnraisableExceptionWarning"
    ),
]


@pytest.fixture(autouse=True)
def _collect_orbax_garbage():
  yield
  gc.collect()


COMMON = ("posttrain_mode=sft_poisoned_for_tests", "eval_interval=0", "async_checkpointing=false")


def _params(checkpoint_dir, step):
  return ocp.load(checkpoint_dir / str(step))["params"]


def test_a_nan_loss_stops_the_run_naming_the_step_and_its_examples_before_any_checkpoint_holds_it(
    make_config, tmp_path, monkeypatch
):
  """The run's own error is the one raised even when closing its metric writers then fails too (as a full disk
  fails both)."""
  close = trainer.MetricLogger.flush_metrics_and_cleanup

  def close_then_fail(logger):
    close(logger)
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(trainer.MetricLogger, "flush_metrics_and_cleanup", close_then_fail)
  config = make_config("steps=5", "checkpoint_period=1", *COMMON, f"metrics_file={tmp_path / 'm.jsonl'}")
  loop = trainer.setup(config)
  with pytest.raises(trainer.NonFiniteStep) as error:
    trainer.train(loop)
  message = str(error.value)
  assert message.startswith(f"Step {POISONED_STEP}: non-finite learning/loss=nan"), message
  listed, _, more = message.split("trained on examples [")[1].split("]")[0].partition(" and ")
  named = [int(i) for i in listed.split(", ")]  # record indices, the first 16, then "and N more"
  assert len(set(named)) == len(named) and named == sorted(named), message
  count = len(named) + (int(more.removesuffix(" more")) if more else 0)
  assert count >= config.global_batch_size_to_train_on, message  # packed rows hold several
  assert "The latest checkpoint is step 1's, from before it" in message and "nonfinite_policy=skip" in message
  checkpoints = tmp_path / "run" / "checkpoints"
  assert sorted(int(p.name) for p in checkpoints.iterdir()) == [0, 1]  # nothing saved at or after the NaN
  saved = jax.tree.leaves(_params(checkpoints, 1))
  assert saved and all(np.isfinite(np.asarray(leaf)).all() for leaf in saved)


def test_nonfinite_policy_skip_goes_on_without_the_update_and_counts_it_across_a_resume(make_config, tmp_path):
  metrics = tmp_path / "m.jsonl"
  crashed = ("steps=4", "save_checkpoint_on_completion=false")
  common = (*COMMON, "nonfinite_policy=skip", "abort_on_nan_loss=false", "abort_on_inf_loss=false")
  common += ("checkpoint_period=3", "learning_rate_schedule_steps=6")
  run_utils.run(make_config(*crashed, *common, f"metrics_file={metrics}"))
  loop, summary = run_utils.run(make_config("steps=6", *common, f"metrics_file={metrics}"))
  assert summary["start_step"] == 4 and loop.nonfinite_steps == 1
  rows = run_utils.rows(metrics)
  assert [rows[s]["learning/nonfinite"] for s in range(6)] == [0, 0, 1, 0, 0, 0]
  assert [rows[s]["learning/nonfinite_steps"] for s in range(6)] == [0, 0, 1, 1, 1, 1]  # kept across the resume
  # The skipped step left weights and optimizer state as step 1 left them.
  assert rows[POISONED_STEP]["learning/param_norm"] == rows[POISONED_STEP - 1]["learning/param_norm"]
  assert rows[POISONED_STEP + 1]["learning/param_norm"] != rows[POISONED_STEP]["learning/param_norm"]
  assert all(np.isfinite(rows[s]["learning/loss"]) for s in range(6) if s != POISONED_STEP)


def test_nonfinite_policy_skip_needs_maxtexts_nan_abort_off(make_config):
  with pytest.raises(ValueError, match="abort_on_nan_loss and abort_on_inf_loss"):
    make_config("nonfinite_policy=skip")


def _sft(make_config, *keys):
  return make_config("eval_interval=0", "async_checkpointing=false", "checkpoint_period=1", *keys)


def test_an_unreadable_latest_checkpoint_is_named_and_can_be_set_aside_for_the_previous_step(make_config, tmp_path):
  metrics = tmp_path / "m.jsonl"
  run_utils.run(_sft(make_config, "steps=3", "learning_rate_schedule_steps=4", f"metrics_file={metrics}"))
  first = run_utils.losses(metrics)
  checkpoints = tmp_path / "run" / "checkpoints"
  largest = max((p for p in (checkpoints / "2").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  with open(largest, "r+b") as f:
    f.truncate(largest.stat().st_size // 2)
  before = {p: p.stat().st_mtime_ns for p in checkpoints.rglob("*")}
  resume = ("steps=4", "learning_rate_schedule_steps=4", f"metrics_file={metrics}")
  with pytest.raises(checkpoint_guard.UnreadableCheckpoint) as error:
    trainer.setup(_sft(make_config, *resume))
  message = str(error.value)
  assert f"step 2 at {checkpoints / '2'}, cannot be read" in message and "resume_readable_checkpoint=true" in message
  assert len(message) < 700 and "\n" not in message, message
  assert {p: p.stat().st_mtime_ns for p in checkpoints.rglob("*")} == before  # nothing changed
  loop, summary = run_utils.run(_sft(make_config, *resume, "resume_readable_checkpoint=true"))
  assert summary["start_step"] == 2 and loop.step == 4
  assert (checkpoints / "2.unreadable").is_dir() and largest.relative_to(checkpoints / "2")  # kept, renamed
  # Step 2 again, from step 1's weights, optimizer state and data position: the loss the first run logged.
  assert run_utils.losses(metrics)[2] == first[2]


@pytest.fixture
def small_disk(tmp_path):
  """A 16 MiB tmpfs: room for two checkpoints of the tiny model (about 7 MB each, with the optimizer state)."""
  mount = tmp_path / "disk"
  mount.mkdir()
  subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], check=True)
  try:
    yield mount
  finally:
    subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_full_disk_during_a_save_is_named_and_leaves_the_earlier_checkpoints_whole(
    make_config, small_disk, asynchronous
):
  config = make_config(
      "eval_interval=0",
      "checkpoint_period=1",
      "steps=6",
      f"async_checkpointing={str(asynchronous).lower()}",
      f"base_output_directory={small_disk}",
  )
  with pytest.raises(checkpoint_guard.CheckpointWriteFailed) as error:
    run_utils.run(config)
  message = str(error.value)
  checkpoints = small_disk / "run" / "checkpoints"
  assert f"to {checkpoints} failed" in message and "No space left on device" in message, message
  complete = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
  assert complete[:2] == [0, 1] and f"{complete}" in message, (complete, message)
  for step in complete:
    leaves = jax.tree.leaves(_params(checkpoints, step))
    assert leaves and all(np.isfinite(np.asarray(leaf)).all() for leaf in leaves)


def test_a_long_storage_error_keeps_the_operating_systems_reason():
  """tensorstore's message for a full disk names the array, its whole spec, then `[os_error_code='28']`: cut to one
  line, its reason would fall in the cut (as an asynchronous save's did), so the line starts with it."""
  brief = checkpoint_guard._brief  # pylint: disable=protected-access
  array, spec = "opt_state." + "x" * 200, "{" + "y" * 200 + "}"
  tensorstore = f"RESOURCE_EXHAUSTED: Error writing {array}: No space left on device; {spec} [os_error_code='28']"
  line = brief(ValueError(tensorstore))
  assert line.startswith("No space left on device (OS error 28): ValueError: RESOURCE_EXHAUSTED") and len(line) < 300
  assert brief(OSError(28, "No space left on device")).count("No space") == 1


def test_a_resume_that_changes_what_the_run_trains_on_is_refused_naming_the_keys(make_config, tmp_path):
  run_utils.run(_sft(make_config, "steps=1"))
  with pytest.raises(ValueError, match="changes what the run trains on") as error:
    trainer.setup(_sft(make_config, "steps=2", "data_shuffle_seed=7", "train_data_columns=[question,question]"))
  message = str(error.value)
  assert "data_shuffle_seed: 0 -> 7" in message, message
  assert "train_data_columns: ['question', 'answer'] -> ['question', 'question']" in message, message
  assert "train_data (the train split's tokens): fingerprint" in message, message
  assert not (tmp_path / "run" / "checkpoints" / "1").exists()
  allowed = "resume_config_changes=[data_shuffle_seed,train_data_columns,train_data]"
  loop = trainer.setup(
      _sft(make_config, "steps=2", "data_shuffle_seed=7", "train_data_columns=[question,question]", allowed)
  )
  assert loop.start_step == 1

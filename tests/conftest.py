"""Shared fixtures: tiny configs over the bundled arithmetic data, built once per session."""

import fcntl
import json
import os
import pathlib
import shutil

import pytest

# Written into a shared fixture's directory once its build has finished (see `_built_once`).
_BUILT = "BUILT"


def _built_once(tmp_path_factory, name: str, build) -> pathlib.Path:
  """The directory `build(directory)` filled, built once per test session.

  Session fixtures are per process, and pytest-xdist runs one process per worker: each worker would train the same
  seeded models again (minutes of the suite's wall time). So under xdist the workers share one directory beside their
  own base temp directories, as pytest-xdist documents: the first worker to ask builds it under a file lock, the
  others wait for that lock and then read what it wrote. A build that raised leaves no marker; the next worker to ask
  starts over from an empty directory (a half-written run directory would otherwise be resumed) and fails alike.
  Without xdist the directory sits in this session's own base temp directory."""
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER") is not None:
    root = root.parent  # this session's, shared by its workers
  directory = root / name
  with open(root / f"{name}.lock", "w", encoding="utf-8") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    if not (directory / _BUILT).exists():
      shutil.rmtree(directory, ignore_errors=True)
      directory.mkdir()
      build(directory)
      (directory / _BUILT).touch()
  return directory


# Rough seconds of the slowest test files on one worker of the 2-worker suite (from `--durations=0` of a full-suite run
# on the 2-core machine, c612b10's; a file's figure includes the session fixtures it happened to build first).
# `pytest_xdist_make_scheduler` below starts the costliest first; files not listed follow in pytest-xdist's own order
# (most tests first). Update it as files grow.
_FILE_SECONDS = {
    "test_reward_model.py": 560,
    "test_multiprocess.py": 335,
    "test_preference.py": 230,
    "test_distill.py": 140,
    "test_peft.py": 160,
    "test_grpo.py": 150,
    "test_benchmarks.py": 110,
    "test_sharding.py": 105,
    "test_ppo.py": 95,
    "test_drills.py": 90,
    "test_distill_on_policy.py": 80,
    "test_trainer.py": 75,
    "test_installed.py": 70,
    "test_cli.py": 45,
    "test_peft_precision.py": 55,
    "test_demo_distill.py": 40,
    "test_safety.py": 60,
    "test_reliability.py": 35,
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  """Under `--dist loadfile`, the costliest files first (longest processing time first).

  pytest-xdist orders files by their number of tests, so the slow files with few tests (the reward model's, the
  multi-process runs, the installed wheel's) would be handed out last, where one of them can run alone on one worker
  for minutes while the other idles. Started first, they overlap, and the many quick files fill the end."""
  if config.getoption("dist") != "loadfile":
    return None
  from xdist.scheduler import LoadFileScheduling  # pylint: disable=import-outside-toplevel

  class CostliestFileFirst(LoadFileScheduling):
    """LoadFileScheduling that hands out the costliest queued file next (the first queued one among equals)."""

    def _assign_work_unit(self, node):
      scope = max(self.workqueue, key=lambda scope: _FILE_SECONDS.get(pathlib.PurePath(scope).name, 0))
      self.workqueue.move_to_end(scope, last=False)
      super()._assign_work_unit(node)

  return CostliestFileFirst(config, log)


@pytest.fixture(scope="session")
def tfds_dir(tmp_path_factory) -> pathlib.Path:
  """One TFDS data_dir per session; the arithmetic builder is prepared into it on first use."""
  return tmp_path_factory.mktemp("tfds")


@pytest.fixture
def make_config(tmp_path, tfds_dir):
  """`make_config(key=value, ...)` -> a PostTrainConfig from a bundled config (sft.yml unless `config_file` names
  another, or a yml path), writing under this test's tmp dir, on the first 2,000 training examples unless an
  override names another train_split (`run_utils.SHORT_TRAIN_SPLIT`)."""
  from maxtext_posttrain import config as posttrain_config  # pylint: disable=import-outside-toplevel
  from tests import run_utils  # pylint: disable=import-outside-toplevel

  def build(*overrides: str, config_file: str = "sft.yml", run_name: str = "run"):
    argv = ["", config_file, f"run_name={run_name}", f"base_output_directory={tmp_path}"]
    argv += [f"dataset_path={tfds_dir}", run_utils.SHORT_TRAIN_SPLIT, *overrides]
    return posttrain_config.initialize(argv)

  return build


@pytest.fixture(scope="session")
def sft_run(tmp_path_factory, tfds_dir):
  """A seeded 200-step SFT run on the bundled arithmetic data, evaluated at steps 0 and 200: the SFT learning test
  reads its curve, and its params are the usual starting point of preference tuning and RL. The run's summary is
  kept as JSON beside it, for the workers that did not run it."""
  from maxtext_posttrain import config as posttrain_config  # pylint: disable=import-outside-toplevel
  from tests import run_utils  # pylint: disable=import-outside-toplevel

  def build(out):
    argv = ["", "sft.yml", "run_name=sft", f"base_output_directory={out}", f"dataset_path={tfds_dir}"]
    argv += ["steps=200", "eval_interval=200", "eval_generation_examples=64", "checkpoint_period=1000"]
    argv += ["async_checkpointing=false", f"metrics_file={out / 'metrics.jsonl'}"]
    _, summary = run_utils.run(posttrain_config.initialize(argv))
    (out / "summary.json").write_text(json.dumps(summary), encoding="utf-8")

  out = _built_once(tmp_path_factory, "sft", build)
  summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
  summary["evals"] = {int(step): results for step, results in summary["evals"].items()}  # JSON keys are strings
  return {
      "summary": summary,
      "losses": run_utils.losses(out / "metrics.jsonl"),
      "checkpoint": out / "sft" / "checkpoints" / "199" / "items",
  }


@pytest.fixture(scope="session")
def sft_checkpoint(sft_run):
  """Params of the 200-step SFT run."""
  return sft_run["checkpoint"]


@pytest.fixture(scope="session")
def deep_sft_checkpoint(tmp_path_factory, tfds_dir):
  """Params of a seeded 200-step SFT run of the same config with run_utils.DEEP_SFT_LAYERS decoder layers: the reward
  model's starting point (the 2-layer decoder's last-token score stays well under 90% held-out pair accuracy) and a
  teacher deeper than the usual 2-layer student."""
  from maxtext_posttrain import config as posttrain_config  # pylint: disable=import-outside-toplevel
  from tests import run_utils  # pylint: disable=import-outside-toplevel

  def build(out):
    argv = ["", "sft.yml", "run_name=sft", f"base_output_directory={out}", f"dataset_path={tfds_dir}", "steps=200"]
    argv += [f"base_num_decoder_layers={run_utils.DEEP_SFT_LAYERS}", "eval_interval=0", "checkpoint_period=1000"]
    argv += ["async_checkpointing=false"]
    run_utils.run(posttrain_config.initialize(argv))

  return _built_once(tmp_path_factory, "deep_sft", build) / "sft" / "checkpoints" / "199" / "items"

"""Multi-process runs on JAX's distributed runtime: `python -m maxtext_posttrain.train` as 2 processes x 2 CPU
devices joined the way MaxText joins pod hosts (scripts/launch_local.sh; the mesh's DCN axis spans the processes),
against 1 process x 4 devices on the same mesh shape. SFT's runs and the kill test run the command itself; the other
objectives run its `main` one after another in one job (tests/train_in_turn.py).

Every test here starts subprocesses: MaxText's CPU coordinator listens on a fixed port (1234), so two jobs at once
would collide, and this file keeps them on one xdist worker, one at a time.
"""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from maxtext_posttrain.objectives import rl_base
from tests import multiprocess_scoring
from tests import run_utils
from tests import train_in_turn

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "scripts" / "launch_local.sh"
PROCESSES, LOCAL_DEVICES = 2, 2
TIMEOUT = 300  # seconds per run of a job; a hang fails the test instead of the suite

# Every run here has MaxText's layers unscanned (the distillation teacher too, as it reads SFT's checkpoint). With
# scanned layers, XLA:CPU now and then deadlocks a 1-process run with 4 devices: the layers' loop holds collectives
# (fsdp all-gathers) and the program has others outside it, and the device threads enter them in different orders (one
# waits in an all-gather over devices 0-1, another in an all-reduce over 0-3; XLA aborts after 40 s: "Termination
# timeout for `all gather RendezvousKey...`. Exiting to ensure a consistent program state"). Measured with DPO's
# reference run, two at a time: 5 aborts in 17 runs scanned, none in 12 unscanned; a 1-process job with SFT and
# distillation scanned aborted twice in a row in one suite run. A TPU runs a program's collectives in program order.
# Most other test files run the scanned layout, MaxText's default.
UNSCANNED = "scan_layers=false"

# Per objective: the bundled config and the keys that make it a few-second run on random weights. RL rewards use a
# reward that varies under random weights (completion length), so the advantages and the loss are not all zero.
RL_KEYS = ("per_device_batch_size=1", "rl.num_generations=4", "max_target_length=80")
CHARACTERS = ("rl.rewards=['tests.rewards_for_tests:characters']", "rl.reward_weights=[1.0]")
# GRPO's run samples with DAPO's dynamic sampling, filtered on a reward most groups agree on under random weights (a
# digit in the completion): steps 0 and 1 sample a second round, and the whole batch's choice moves a group process 0
# sampled into process 1's block (seen when this was written; tests/test_grpo.py checks the moves themselves).
DYNAMIC_SAMPLING = (
    "rl.rewards=['tests.rewards_for_tests:characters','tests.rewards_for_tests:contains_digit']",
    "rl.reward_weights=[1.0,1.0]",
    "rl.dynamic_sampling=true",
    "rl.max_sampling_rounds=3",
    "rl.dynamic_sampling_metric=tests.rewards_for_tests:contains_digit",
)
# SFT's run also serves as the uninterrupted run of the kill test: 12 steps, checkpoints every 2.
SFT_RUN = ("steps=12", "enable_checkpointing=true", "checkpoint_period=2", "async_checkpointing=false")
OBJECTIVES = {
    "sft": ("sft.yml", "per_device_batch_size=2", "packing=false", *SFT_RUN),
    "dpo": ("dpo.yml", "per_device_batch_size=1", "steps=3"),
    "grpo": ("grpo.yml", *RL_KEYS, *DYNAMIC_SAMPLING, "rl.grpo_beta=0.04", "steps=3"),
    # GRPO's run has the reference. Two minibatches per rollout batch: the checkpoint after step 0 falls part-way
    # through one, so each process saves its own rows of it.
    "ppo": ("ppo.yml", *RL_KEYS, *CHARACTERS, "rl.grpo_beta=0.0", "ppo.num_minibatches=2", "steps=3"),
    # The teacher is SFT's 2-process checkpoint (a 2-layer model), read by 2 processes and by 1.
    "distill": (
        "distill.yml",
        "per_device_batch_size=2",
        "packing=false",
        "teacher_overrides.base_num_decoder_layers=2",
        f"teacher_overrides.{UNSCANNED}",
        "steps=3",
    ),
}
# The data probe (tests/multiprocess_data.py) builds the training data of these objectives' configs, as their runs do,
# and reads its first PROBE_STEPS batches; the scoring probe (tests/multiprocess_scoring.py) scores rows in calls with
# SFT's config. Both write to the PROBE directory.
PROBE, PROBED, PROBE_STEPS = "probe", ("sft", "dpo", "grpo"), 3
# The scoring probe's meshes, keys per layout after LAYOUT's: the job's (the batch axis split across the processes in
# blocks, each process building its rows), and tensor parallelism across the processes with the batch replicated
# over them (every process building every row).
SCORING = {
    "scoring": {"two": (), "one": ()},
    "scoring_tensor": {
        "two": ("dcn_tensor_parallelism=2",),
        "one": ("ici_data_parallelism=1", "ici_tensor_parallelism=2"),
    },
}
# Metrics that differ between runs by nature (timings) or by layout (per-device rates).
_VOLATILE = ("perf/", "seconds", "_per_sec", "learning/current_learning_rate")


def _env(**extra) -> dict[str, str]:
  """The subprocesses' environment; Python's fault handler prints every thread's stack when a process dies of a
  signal (an abort in native code), so the log says where."""
  env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
  return env | {"JAX_PLATFORMS": "cpu", "PYTHONFAULTHANDLER": "1", "XLA_FLAGS": run_utils.xla_flags(), **extra}


# The keys that make the same mesh (data 2 x fsdp 2) from 2 processes (DCN data axis over the processes: the
# launcher sets num_slices=2) and from 1 process (ICI data axis).
LAYOUT = {"two": ("skip_jax_distributed_system=false",), "one": (f"ici_data_parallelism={PROCESSES}",)}


def _config_argv(layout: str, config_file: str, out: pathlib.Path, tfds_dir, *keys: str) -> list[str]:
  return [
      str(ROOT / "maxtext_posttrain" / "configs" / config_file),
      "run_name=run",
      f"base_output_directory={out}",
      f"dataset_path={tfds_dir}",
      "eval_interval=-1",
      "log_period=1",
      f"metrics_file={out / 'metrics.jsonl'}",
      UNSCANNED,
      *keys,
      *LAYOUT[layout],
  ]


def launch(argv: list[str], out: pathlib.Path) -> subprocess.Popen:
  """`scripts/launch_local.sh 2 python ...argv` (2 processes x 2 devices), started; output in `out`."""
  out.mkdir(parents=True, exist_ok=True)
  env = _env(LAUNCH_LOG_DIR=str(out / "logs"), LOCAL_DEVICES=str(LOCAL_DEVICES))
  command = [str(LAUNCH), str(PROCESSES), sys.executable, *argv]
  with open(out / "process_0.log", "ab") as log:
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _first_error(log: pathlib.Path) -> str:
  """The log from its first error line on (30 lines), then its last 40 lines (where a signal's stacks are)."""
  lines = [line for line in log.read_text(errors="replace").splitlines() if "Config param" not in line]
  start = next((i for i, line in enumerate(lines) if "Error" in line or "Fatal" in line or "error:" in line), None)
  head = [] if start is None else lines[start : start + 30]
  return "\n".join(head + ["..."] + lines[-40:])


def finish(process: subprocess.Popen, out: pathlib.Path, runs: int = 1) -> None:
  rc = process.wait(timeout=TIMEOUT * runs)
  logs = "\n".join(f"{f}:\n{_first_error(f)}" for f in sorted(out.glob("**/process_*.log")))
  assert rc == 0, f"exit status {rc}:\n{logs}"


def _single(argv: list[str], out: pathlib.Path, runs: int) -> int:
  out.mkdir(parents=True, exist_ok=True)
  env = _env(XLA_FLAGS=run_utils.xla_flags(PROCESSES * LOCAL_DEVICES))
  with open(out / "single.log", "wb") as log:
    return subprocess.run(
        [sys.executable, *argv],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        timeout=TIMEOUT * runs,
        check=False,
    ).returncode


# Should XLA:CPU's rendezvous abort (above) still end a job, it is run again, once, from scratch; any other failure
# fails the test.
_XLA_CPU_RENDEZVOUS_ABORT = "Exiting to ensure a consistent program state"


def _aborted_in_xla_cpu_rendezvous(out: pathlib.Path) -> bool:
  return any(_XLA_CPU_RENDEZVOUS_ABORT in log.read_text(errors="replace") for log in out.glob("**/*.log"))


def single(argv: list[str], out: pathlib.Path, runs: int = 1) -> None:
  """One process with 2 x 2 devices: the mesh of the 2-process job with its DCN axis as an ICI axis."""
  rc = _single(argv, out, runs)
  if rc != 0 and _aborted_in_xla_cpu_rendezvous(out):
    print(f"{out}: XLA:CPU rendezvous abort; running again:\n{_first_error(out / 'single.log')}")
    shutil.rmtree(out)
    rc = _single(argv, out, runs)
  assert rc == 0, f"exit status {rc}, see {out / 'single.log'}:\n" + _first_error(out / "single.log")


def two_processes(argv: list[str], out: pathlib.Path, runs: int = 1) -> None:
  """`argv` (`runs` training runs) as a 2-process job from scratch, to its end (again, once, after an XLA:CPU
  rendezvous abort)."""
  process = launch(argv, out)
  if process.wait(timeout=TIMEOUT * runs) != 0 and _aborted_in_xla_cpu_rendezvous(out):
    print(f"{out}: XLA:CPU rendezvous abort; running again")
    shutil.rmtree(out)
    process = launch(argv, out)
  finish(process, out, runs)


def _comparable(row: dict) -> dict[str, float]:
  return {k: v for k, v in row.items() if isinstance(v, float) and not any(part in k for part in _VOLATILE)}


def assert_same_rows(got: dict[int, dict], want: dict[int, dict], rtol: float = 2e-5) -> None:
  assert sorted(got) == sorted(want)
  for step in want:
    got_row, want_row = _comparable(got[step]), _comparable(want[step])
    assert sorted(got_row) == sorted(want_row), step
    for key in want_row:
      np.testing.assert_allclose(got_row[key], want_row[key], rtol=rtol, atol=1e-6, err_msg=f"step {step} {key}")


def train_argv(layout: str, objective: str, out: pathlib.Path, tfds_dir, *keys: str) -> list[str]:
  config_file, *objective_keys = OBJECTIVES[objective]
  return ["-m", "maxtext_posttrain.train", *_config_argv(layout, config_file, out, tfds_dir, *objective_keys, *keys)]


@pytest.fixture(scope="module")
def sft_two_processes(tmp_path_factory, tfds_dir) -> pathlib.Path:
  """The output directory of SFT's uninterrupted 2-process run."""
  out = tmp_path_factory.mktemp("sft_two")
  two_processes(train_argv("two", "sft", out, tfds_dir), out)
  return out


@pytest.fixture(scope="module")
def objective_runs(tmp_path_factory, tfds_dir, sft_two_processes) -> dict[str, dict[str, pathlib.Path]]:
  """Each objective's output directory per layout ("two", "one"), and the probes' (PROBE). Besides SFT's
  (`sft_two_processes`), the 2-process runs are one job that runs them in turn, then the probes (tests/train_in_turn.py:
  `maxtext_posttrain.train.main` on each argv), and the 1-process runs one process: a process's start-up costs more
  than a run of these few steps. The tests of the runs and the probes' share this fixture, so a failure of one job
  errors them all."""
  root = tmp_path_factory.mktemp("objectives")
  teacher = sft_two_processes / "run" / "checkpoints" / "11" / "items"  # a checkpoint written by 2 processes
  keys = {"distill": (f"teacher_overrides.load_parameters_path={teacher}",)}
  runs = {layout: {name: root / layout / name for name in (*OBJECTIVES, PROBE)} for layout in LAYOUT}
  runs["two"]["sft"] = sft_two_processes

  def in_turn(layout: str, names: list[str]) -> list[str]:
    argv = ["-m", "tests.train_in_turn"]
    for name in names:
      config_file, *objective_keys = OBJECTIVES[name]
      argv += _config_argv(layout, config_file, runs[layout][name], tfds_dir, *objective_keys, *keys.get(name, ()))
      argv.append(train_in_turn.SEPARATOR)
    probe = runs[layout][PROBE]
    for name in PROBED:
      config_file, *objective_keys = OBJECTIVES[name]
      argv += ["@tests.multiprocess_data", str(probe), str(PROBE_STEPS), name]
      argv += _config_argv(layout, config_file, probe / name, tfds_dir, *objective_keys)
      argv.append(train_in_turn.SEPARATOR)
    sft_file, *sft_keys = OBJECTIVES["sft"]
    for name, mesh_keys in SCORING.items():
      argv += ["@tests.multiprocess_scoring", str(probe), name]
      argv += [*_config_argv(layout, sft_file, probe / name, tfds_dir, *sft_keys), *mesh_keys[layout]]
      argv.append(train_in_turn.SEPARATOR)
    return argv[:-1]

  probe_runs = 2  # the probes' calls take about two training runs' time
  two_processes(
      in_turn("two", [name for name in OBJECTIVES if name != "sft"]), root / "two", len(OBJECTIVES) - 1 + probe_runs
  )
  single(in_turn("one", list(OBJECTIVES)), root / "one", len(OBJECTIVES) + probe_runs)
  return runs


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_two_processes_train_as_one_process_with_as_many_devices(objective, objective_runs):
  """Losses, rewards and every other logged figure of 2 processes x 2 devices equal those of 1 process x 4 devices
  step by step. RL rollouts are sampled and scored on the process that owns the prompts (each row once); the
  distillation teacher is a checkpoint written by a 2-process job."""
  two, one = objective_runs["two"][objective], objective_runs["one"][objective]
  two_rows, one_rows = run_utils.rows(two / "metrics.jsonl"), run_utils.rows(one / "metrics.jsonl")
  assert_same_rows(two_rows, one_rows)
  # The split's counts and fingerprint, from a setup pass that each process ran on its half, are one process's.
  manifests = [json.loads((out / "run" / "manifest.json").read_text())["data"] for out in (two, one)]
  assert manifests[0] == manifests[1]
  if objective == "grpo":
    assert all(row["rl/reward_mean"] > 0 for row in two_rows.values())
    assert max(row["rl/sampling_rounds"] for row in two_rows.values()) > 1
  if objective == "ppo":  # steps 0 and 2 draw a rollout batch, step 1 trains on the second minibatch of step 0's
    assert [step for step, row in sorted(two_rows.items()) if "rl/reward_mean" in row] == [0, 2]
    assert all(two_rows[step]["rl/reward_mean"] > 0 for step in (0, 2))
    saved = sorted((two / "run" / "objective_state").glob("0.rows.*"))
    assert [path.name for path in saved] == ["0.rows.0.npz", "0.rows.1.npz"], saved
    rows = [np.load(path) for path in saved]  # each process's half of the batch: 2 prompts x 4 completions
    assert [len(r["inputs"]) for r in rows] == [8, 8] and [len(r[rl_base.ROLLOUT_PROMPTS]) for r in rows] == [2, 2]
    assert not set(rows[0][rl_base.ROLLOUT_PROMPTS]) & set(rows[1][rl_base.ROLLOUT_PROMPTS])


def test_no_example_is_read_by_two_processes(objective_runs):
  """Each process's rows of each step hold examples no other process holds, and together the processes' rows are
  the examples one process reads for the same steps; each process reads and tokenizes about half of the split (the
  data probe, tests/multiprocess_data.py, run last in each layout's job of `objective_runs`)."""
  two, one_dir = objective_runs["two"][PROBE], objective_runs["one"][PROBE]
  for name in PROBED:
    summaries = [json.loads((two / f"{name}.{p}.json").read_text()) for p in range(PROCESSES)]
    one = json.loads((one_dir / f"{name}.0.json").read_text())
    # Each process reads (and tokenizes) its half of the split in the setup pass and the examples of its batches
    # (with grain's read-ahead); one process reads them all.
    (size,) = one["source_sizes"]
    assert one["reads"] >= size, name
    assert all(summary["reads"] <= size / PROCESSES + size / 10 for summary in summaries), (name, size, summaries)
    parts, whole = [summary["steps"] for summary in summaries], one["steps"]
    for step in range(PROBE_STEPS):
      rows = [part[step] for part in parts]
      assert all(len(r) == len(whole[step]) // PROCESSES for r in rows), (name, step)
      assert not set(rows[0]) & set(rows[1]), (name, step)
      assert sorted(rows[0] + rows[1]) == sorted(whole[step]), (name, step)


@pytest.mark.parametrize("mesh", sorted(SCORING))
def test_rows_scored_in_calls_are_built_by_their_process_and_gathered_on_all(mesh, objective_runs):
  """`FrozenModel.run_over_rows` (DPO's precomputed reference, canary exposure, score_teacher) over 10 rows in calls
  of the global batch: each process builds its block of each call's rows (the last call filled with the last row),
  or every row where the batch does not split across the processes, and every process gets every row's score, the
  scores one process computes alone (tests/multiprocess_scoring.py, run last in each layout's job of
  `objective_runs`)."""
  two, one_dir = objective_runs["two"][PROBE], objective_runs["one"][PROBE]
  parts = [json.loads((two / f"{mesh}.{p}.json").read_text()) for p in range(PROCESSES)]
  one = json.loads((one_dir / f"{mesh}.0.json").read_text())
  rows, size = multiprocess_scoring.ROWS, one["batch_size"]
  calls = [[min(i, rows - 1) for i in range(start, start + size)] for start in range(0, rows, size)]
  assert one["built"] == calls and len(calls) > 1 and rows % size
  for call, indices in enumerate(calls):
    if mesh == "scoring_tensor":
      assert [part["built"][call] for part in parts] == [indices] * PROCESSES
    else:
      assert [part["built"][call] for part in parts] == [indices[: size // PROCESSES], indices[size // PROCESSES :]]
  assert len(one["scores"]) == rows and len(set(one["scores"])) == rows
  for part in parts:
    np.testing.assert_allclose(part["scores"], one["scores"], rtol=2e-5)


def test_a_killed_process_stops_the_job_and_the_relaunch_resumes_exactly(tmp_path, tfds_dir, sft_two_processes):
  """SIGKILL of one process mid-run: the launcher stops the other (no hang) and exits non-zero; the same command
  line then resumes from the last checkpoint both processes wrote and logs what an uninterrupted run logs."""
  killed = tmp_path / "killed"
  argv = train_argv("two", "sft", killed, tfds_dir)
  job = launch(argv, killed)
  deadline = time.monotonic() + TIMEOUT
  while not (killed / "run" / "checkpoints" / "2").is_dir():
    assert job.poll() is None and time.monotonic() < deadline, "the run ended before its step-2 checkpoint"
    time.sleep(0.02)
  os.kill(int((killed / "logs" / "process_1.pid").read_text()), signal.SIGKILL)
  killed_at = time.monotonic()
  assert job.wait(timeout=60) != 0
  assert time.monotonic() - killed_at < 30
  assert "process 1" in (killed / "process_0.log").read_text()
  finish(launch(argv, killed), killed)
  (resume,) = json.loads((killed / "run" / "manifest.json").read_text())["resumes"]
  assert 0 < resume["start_step"] < 12
  assert_same_rows(run_utils.rows(killed / "metrics.jsonl"), run_utils.rows(sft_two_processes / "metrics.jsonl"))


def test_the_launcher_sets_maxtexts_environment_and_stops_at_the_first_failure(tmp_path):
  """Each process sees the variables MaxText's CPU start-up reads; when process 1 fails, process 0 (still sleeping)
  is stopped and the launcher exits with process 1's status at once."""
  script = (
      "import json, os, sys, time\n"
      "names = ('JAX_COORDINATOR_ADDRESS', 'JOB_INDEX', 'JOB_COMPLETION_INDEX', 'PROCESSES_IN_JOB', 'JAX_PROCESS_COUNT',"
      " 'M_HARDWARE', 'M_NUM_SLICES', 'XLA_FLAGS')\n"
      f"open('{tmp_path}/env.' + os.environ['JOB_COMPLETION_INDEX'], 'w').write(json.dumps({{n: os.environ.get(n) for n in names}}))\n"
      "if os.environ['JOB_COMPLETION_INDEX'] == '0':\n"
      "  time.sleep(120)\n"
      f"while not os.path.exists('{tmp_path}/env.0'):\n"
      "  time.sleep(0.01)\n"
      "sys.exit(3)\n"
  )
  start = time.monotonic()
  job = launch(["-c", script], tmp_path)
  assert job.wait(timeout=60) == 3
  assert time.monotonic() - start < 30
  for index in range(PROCESSES):
    env = json.loads((tmp_path / f"env.{index}").read_text())
    assert env["JOB_COMPLETION_INDEX"] == str(index) and env["JOB_INDEX"] == "0"
    assert env["PROCESSES_IN_JOB"] == env["JAX_PROCESS_COUNT"] == env["M_NUM_SLICES"] == str(PROCESSES)
    assert env["M_HARDWARE"] == "cpu" and env["JAX_COORDINATOR_ADDRESS"] == "localhost"
    assert f"--xla_force_host_platform_device_count={LOCAL_DEVICES}" in env["XLA_FLAGS"]
  assert "process 1" in (tmp_path / "process_0.log").read_text()

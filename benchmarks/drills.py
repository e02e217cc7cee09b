"""Reliability drills: training processes SIGKILLed at seeded random moments and restarted with the same command line
until they finish must log what the uninterrupted run logs, bit for bit, and lose no finished checkpoint.

Per objective, on the tiny model with a checkpoint after every step (`checkpoint_period=1`):

1. the reference: one uninterrupted run, `python -m maxtext_posttrain.train` with async_checkpointing=false, which
   compiles every program afresh into an empty persistent compilation cache;
2. killed runs of the same command (each in a directory of its own): every launch but the last goes through
   `tests.drill_hooks`, which SIGKILLs the process at the moment of its kill, and the next launch, with the same
   training arguments, resumes from what the killed one left on disk. Their launches load the reference's programs
   from the cache (a restart skips most compilation), so every comparison with the reference also checks that a
   program from the cache computes what the freshly compiled one did.

The seed picks, per kill, the phase (those the objective has), the step, the delay and async_checkpointing:

  step        a random delay after the step's train step is called, up to the reference's median step time;
  rollout     (RL) a random delay after the rollouts are dispatched, while the sampler decodes;
  checkpoint  inside the write of the step's checkpoint (the primary role's): a random delay into the background
              write (`write`), just before orbax renames the finished temporary directory (`commit`), or just after
              (`renamed`).

A killed run holds the kills of one async_checkpointing value at increasing steps, so each kill's moment comes after
the step its predecessor's restart resumes from; more kills than steps take more runs.

Checked per kill, once the launch that restarted after it has ended (killed by the next kill, or finished):

- exact resume: that launch resumed from the newest checkpoint finalized when the process died, ended as planned (the
  next kill or exit status 0), every metrics row it wrote equals the reference's row of its step in every figure but
  timings (`perf/*`, names with seconds, time, tokens_per_sec, tflops) as JSON spells them (bit-identical floats),
  the logged steps still run 0, 1, 2, ... without a gap and, for the last launch, reach the final step;
- checkpoints lost: steps whose checkpoint was finalized on disk when the process died and that the restart left
  missing or rewritten, or that no longer load at the end of the run;
- steps re-run: from the step the restart resumed at to the killed step.

At the end of each run every checkpoint it holds is loaded and compared with the reference's of the same step
(arrays and data iterator state, bit for bit). Prints one line per kill, a table, and one line per objective
`drills: objective=<name> kills=<n> exact_resumes=<n> checkpoints_lost=<n>`; writes the JSON result to --output.

  python -m benchmarks.drills [key=value ...] [--objectives=sft,dpo,grpo] [--kills=5] [--seed=0] [--steps=6]
      [--output=benchmark_drills.json] [--workdir=path]

--objectives picks from sft, dpo, grpo, ppo and distill; the default leaves out the two whose launches carry a second
model (PPO's critic, distillation's teacher). Distillation loads its teacher's weights, so its drill first trains a
teacher once: a few steps of sft.yml in the shape of distill.yml's `teacher_overrides` (4 decoder layers), whose last
checkpoint every distill launch, the reference's and the killed ones', loads (`teacher_overrides.load_parameters_path`).

`key=value` arguments are appended to every run's command line (`dataset_path=...`). Run on a CPU: the runs are the
tiny model, single-process (`JAX_PLATFORMS=cpu`).
"""

import collections
import contextlib
import dataclasses
import json
import os
import pathlib
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import jax
import numpy as np
import yaml
from orbax.checkpoint import v1 as ocp

from benchmarks import harness
from maxtext_posttrain import config as config_lib

REPO = pathlib.Path(__file__).resolve().parents[1]

# Per objective: the bundled config and the keys that make it a run of a few seconds. The RL reward varies under
# random weights (completion length), so advantages and losses are not all zero; beta > 0 adds GRPO's reference. PPO
# trains two roles, the critic saved before the policy at each step; distillation learns from a teacher that
# `teacher_keys` trains first (neither is among the defaults).
OBJECTIVES = {
    "sft": ("sft.yml", "per_device_batch_size=4"),
    "dpo": ("dpo.yml", "per_device_batch_size=2"),
    "grpo": (
        "grpo.yml",
        "per_device_batch_size=1",
        "rl.num_generations=4",
        "max_target_length=80",
        "rl.grpo_beta=0.04",
        "rl.rewards=['tests.rewards_for_tests:characters']",
        "rl.reward_weights=[1.0]",
    ),
    "ppo": (
        "ppo.yml",
        "per_device_batch_size=1",
        "rl.num_generations=4",
        "max_target_length=80",
        "rl.rewards=['tests.rewards_for_tests:characters']",
        "rl.reward_weights=[1.0]",
    ),
    "distill": ("distill.yml", "per_device_batch_size=4"),
}
RL_OBJECTIVES = ("grpo", "ppo")
PHASES = {"step": ("step",), "rollout": ("rollout",), "checkpoint": ("write", "commit", "renamed")}
# Figures that differ between runs by nature.
VOLATILE = ("perf/", "seconds", "time", "tokens_per_sec", "tflops")
# Delay scales of the moments. The tiny model's checkpoint (7.5 MiB) is written in about 0.1 s in the background on a
# 2-core CPU. Its decode program runs for about a quarter of `rl/rollout_seconds` (dispatch to rows on the host), so
# kills within 0.15 of it mostly strike while it decodes (tests.drill_hooks records whether they did).
WRITE_SECONDS = 0.1
DECODE_SHARE = 0.15
TIMEOUT = 600  # seconds per launch
# Distillation's teacher: a few steps of the SFT run with distill.yml's `teacher_overrides`. Any trained weights of its
# shape serve; a drill's kills and comparisons are all the student's.
TEACHER_STEPS = 2


def phase_of(moment: str) -> str:
  return next(phase for phase, moments in PHASES.items() if moment in moments)


@dataclasses.dataclass
class Kill:
  """A planned kill and, once its run is over, what came of it."""

  moment: str
  step: int
  delay: float = 0.0
  landed: str | None = None  # where it struck (tests.drill_hooks); None: the run finished first
  newest_checkpoint: int | None = None  # the newest finalized checkpoint when the process died
  resumed_at: int | None = None  # the restart's first step
  exact: bool = False
  lost: list[int] = dataclasses.field(default_factory=list)  # finalized checkpoint steps the restart lost
  problem: str = ""  # the first difference, or how the restart failed

  @property
  def steps_rerun(self) -> int:
    return 0 if self.resumed_at is None else max(0, self.step + 1 - self.resumed_at)


@dataclasses.dataclass
class Run:
  """A killed run: its kills, one async_checkpointing value, and what the run as a whole showed."""

  async_checkpointing: bool
  kills: list[Kill]
  # The first launch's differing rows, processes a launch left running, unreadable or differing checkpoints.
  problems: list[str] = dataclasses.field(default_factory=list)
  unreadable: list[int] = dataclasses.field(default_factory=list)  # checkpoint steps that no longer load
  checkpoints_differ: list[int] = dataclasses.field(default_factory=list)  # ... or hold another state
  launch_seconds: list[float] = dataclasses.field(default_factory=list)


def train_argv(objective: str, out: pathlib.Path, steps: int, async_checkpointing: bool, *keys: str) -> list[str]:
  """The training command's arguments: the objective's tiny run writing under `out`, a checkpoint every step."""
  config_file, *objective_keys = OBJECTIVES[objective]
  return [
      config_file,
      "run_name=run",
      f"base_output_directory={out}",
      f"metrics_file={out / 'metrics.jsonl'}",
      f"steps={steps}",
      "eval_interval=0",
      "enable_checkpointing=true",
      "checkpoint_period=1",
      f"async_checkpointing={str(async_checkpointing).lower()}",
      *objective_keys,
      *keys,
  ]


def _launch(module: list[str], argv: list[str], log: pathlib.Path) -> tuple[int, list[int]]:
  """`python -m <module> <argv>` from the repository in a session of its own, output appended to `log`: its exit
  status and the processes it left running (reward workers that outlived a killed trainer), killed now. Every
  program is kept in the persistent compilation cache (when the command line names one), however quickly it
  compiled."""
  env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  with open(log, "ab") as f:
    command = [sys.executable, "-m", *module, *argv]
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
      return process.wait(timeout=TIMEOUT), _left_running(process.pid)
    finally:
      for pid in _session(process.pid):
        with contextlib.suppress(ProcessLookupError):
          os.kill(pid, signal.SIGKILL)


def _session(session: int) -> list[int]:
  """The live processes (zombies left out) of `session`."""
  found = []
  for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
    try:
      state, _, _, sid = stat.read_text().rsplit(")", 1)[1].split()[:4]
    except (OSError, IndexError):
      continue  # gone meanwhile
    if state != "Z" and int(sid) == session:
      found.append(int(stat.parent.name))
  return found


def _left_running(session: int, grace: float = 5.0) -> list[int]:
  """The processes of an ended launch's session still running after `grace` seconds."""
  deadline = time.monotonic() + grace
  while (found := _session(session)) and time.monotonic() < deadline:
    time.sleep(0.05)
  return found


def _last_line(log: pathlib.Path) -> str:
  lines = log.read_text(errors="replace").strip().splitlines()
  return lines[-1] if lines else ""


def read_rows(metrics_file: pathlib.Path) -> list[dict]:
  if not metrics_file.exists():
    return []
  return [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]


def _figures(row: dict) -> dict[str, float]:
  return {
      k: v
      for k, v in row.items()
      if k != "step" and isinstance(v, (int, float)) and not any(part in k for part in VOLATILE)
  }


def _key(row: dict) -> tuple:
  """Train rows by step; the data counts each launch logs at its first step as one row."""
  return ("data",) if all(k.startswith("data/") for k in _figures(row)) else ("train", int(row["step"]))


def differences(rows: list[dict], reference: list[dict]) -> list[str]:
  """Each difference between `rows` and the reference's row of the same step, figure by figure, as JSON spells the
  values (bit-identical floats; NaN equals NaN)."""
  want = {_key(row): _figures(row) for row in reference}
  found = []
  for row in rows:
    key, got = _key(row), _figures(row)
    if key not in want:
      found.append(f"{key}: no such row in the reference")
      continue
    for name in sorted(got.keys() | want[key].keys()):
      mine, theirs = json.dumps(got.get(name)), json.dumps(want[key].get(name))
      if mine != theirs:
        found.append(f"step {row['step']:g} {name}: {mine} != reference {theirs}")
  return found


def row_problems(written: list[dict], rows: list[dict], reference: list[dict], steps: int | None) -> list[str]:
  """What is wrong after a launch: the rows it `written` that differ from the reference's, a gap in the steps the
  metrics file's `rows` log, and, for a run that finished its `steps`, the steps it never logged."""
  found = differences(written, reference)
  logged = sorted({key[1] for key in map(_key, rows) if key[0] == "train"})
  if logged != list(range(len(logged))):
    found.append(f"the logged steps {logged} have a gap")
  if steps is not None and logged != list(range(steps)):
    found.append(f"the finished run logged steps {logged}, not 0..{steps - 1}")
  return found


def _finalized(run_dir: pathlib.Path) -> dict[int, str]:
  """The primary role's finalized checkpoints (orbax renames a step's directory into place once it is complete):
  step -> its commit record (the step's metadata file; empty if unreadable)."""
  steps = {}
  for path in (run_dir / "checkpoints").glob("*"):
    if path.name.isdigit():
      try:
        steps[int(path.name)] = (path / "_CHECKPOINT_METADATA").read_text()
      except OSError:
        steps[int(path.name)] = ""
  return steps


def _resumed_at(run_dir: pathlib.Path) -> int | None:
  """The step the latest launch started at (the manifest records every resume), or None if it never got there."""
  try:
    manifest = json.loads((run_dir / "manifest.json").read_text())
  except (OSError, ValueError):
    return None
  return (manifest.get("resumes") or [manifest["first_run"]])[-1]["start_step"]


def _load_checkpoint(step_dir: pathlib.Path) -> tuple[list[bytes], str]:
  """A checkpoint's arrays (as bytes, PRNG keys as their key data) and its data iterator state."""
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "Sharding info not provided")  # the default: the sharding it was saved with
    arrays = jax.tree.leaves(ocp.load_checkpointables(step_dir, {"items": None})["items"])
  arrays = [jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x for x in arrays]
  data_state = "".join(p.read_text() for p in sorted((step_dir / "iter").glob("*.json")))
  return [f"{x.dtype}{x.shape}".encode() + np.asarray(x).tobytes() for x in arrays], data_state


def teacher_keys(out: pathlib.Path, *keys: str) -> tuple[str, ...]:
  """Trains distillation's teacher under `out`: `TEACHER_STEPS` of the SFT run (with the drill's `keys`) in the
  shape of distill.yml's `teacher_overrides`, into a compilation cache of its own, so that the distill reference
  still compiles into an empty one. The key that has a distill launch load its last checkpoint."""
  out.mkdir(parents=True, exist_ok=True)
  with open(config_lib.resolve_config_file("distill.yml"), encoding="utf-8") as f:
    shape = [f"{key}={value}" for key, value in yaml.safe_load(f)["teacher_overrides"].items()]
  argv = train_argv("sft", out, TEACHER_STEPS, False, f"jax_cache_dir={out / 'jax_cache'}", *keys, *shape)
  if _launch(["maxtext_posttrain.train"], argv, out / "launches.log")[0] != 0:
    raise RuntimeError(f"distill: the teacher's run failed: {_last_line(out / 'launches.log')}")
  return (f"teacher_overrides.load_parameters_path={out / 'run' / 'checkpoints' / str(TEACHER_STEPS - 1) / 'items'}",)


# Per objective, what its runs need made first (under the directory given), as the keys every launch adds.
SETUP = {"distill": teacher_keys}


def reference_run(objective: str, out: pathlib.Path, steps: int, cache_dir: pathlib.Path, *keys: str) -> list[dict]:
  """The uninterrupted run, compiling every program afresh into the (empty) compilation cache `cache_dir`; its
  metrics rows."""
  out.mkdir(parents=True, exist_ok=True)
  argv = train_argv(objective, out, steps, False, f"jax_cache_dir={cache_dir}", *keys)
  if _launch(["maxtext_posttrain.train"], argv, out / "launches.log")[0] != 0:
    raise RuntimeError(f"{objective}: the reference run failed: {_last_line(out / 'launches.log')}")
  return read_rows(out / "metrics.jsonl")


def killed_run(
    objective: str,
    out: pathlib.Path,
    run: Run,
    reference: pathlib.Path,
    steps: int,
    cache_dir: pathlib.Path,
    *keys: str,
    report=print,
) -> Run:
  """Runs `run`'s kills in order, each launch after a kill restarting with the same training arguments, then a last
  launch to the end, and judges each kill by the launch after it (see the module docstring). `reference` is the
  reference run's output directory, `cache_dir` the compilation cache it filled."""
  out.mkdir(parents=True, exist_ok=True)
  argv = train_argv(objective, out, steps, run.async_checkpointing, f"jax_cache_dir={cache_dir}", *keys)
  run_dir, metrics, log, kill_log = out / "run", out / "metrics.jsonl", out / "launches.log", out / "kills.jsonl"
  reference_rows = read_rows(reference / "metrics.jsonl")
  restarted_after: Kill | None = None  # the kill the coming launch restarts after
  finalized_at_kill: dict[int, str] = {}
  fired = 0
  for kill in [*run.kills, None]:
    rows_before = read_rows(metrics)
    hooks = [] if kill is None else [kill.moment, str(kill.step), f"{kill.delay:.6f}", str(kill_log), "--"]
    started = time.perf_counter()
    rc, left_running = _launch(["tests.drill_hooks", *hooks] if hooks else ["maxtext_posttrain.train"], argv, log)
    run.launch_seconds.append(time.perf_counter() - started)
    if left_running:
      run.problems.append(f"launch {len(run.launch_seconds)} left processes {left_running} running")
    killed = kill is not None and rc == -signal.SIGKILL
    rows = read_rows(metrics)
    # A launch from step 0 empties the file; otherwise it appends.
    written = rows[len(rows_before) :] if rows[: len(rows_before)] == rows_before else rows
    found = [] if killed or rc == 0 else [f"the launch exited with status {rc}: {_last_line(log)}"]
    found += row_problems(written, rows, reference_rows, steps if rc == 0 else None)
    if restarted_after is None:
      run.problems += [f"before any kill: {difference}" for difference in found]
    else:
      restarted_after.resumed_at = _resumed_at(run_dir) if killed or rc == 0 else None
      newest = restarted_after.newest_checkpoint
      if (killed or rc == 0) and restarted_after.resumed_at != (-1 if newest is None else newest) + 1:
        found.insert(0, f"resumed at step {restarted_after.resumed_at}; the newest finished checkpoint was {newest}")
      now = _finalized(run_dir)
      lost = [step for step, record in finalized_at_kill.items() if not record or now.get(step) != record]
      restarted_after.lost = sorted(lost)
      restarted_after.exact, restarted_after.problem = not found, found[0] if found else ""
      report(_kill_line(objective, run, restarted_after))
    if not killed:
      break  # finished (a kill that did not strike in time never will) or failed: nothing to restart
    records = kill_log.read_text().splitlines() if kill_log.exists() else []
    # A kill from outside the drill (the kernel's OOM killer) leaves no record of its own.
    kill.landed = json.loads(records[-1])["landed"] if len(records) == fired + 1 else "killed without a record"
    fired += 1
    finalized_at_kill, restarted_after = _finalized(run_dir), kill
    kill.newest_checkpoint = max(finalized_at_kill, default=None)
  for step in sorted(_finalized(run_dir)):
    try:
      saved = _load_checkpoint(run_dir / "checkpoints" / str(step))
    except Exception as error:  # pylint: disable=broad-exception-caught
      run.unreadable.append(step)
      run.problems.append(f"checkpoint {step} does not load: {' '.join(str(error).split())[:300]}")
      continue
    if saved != _load_checkpoint(reference / "run" / "checkpoints" / str(step)):
      run.checkpoints_differ.append(step)
  if run.checkpoints_differ:
    run.problems.append(f"the checkpoints of steps {run.checkpoints_differ} differ from the reference's")
  return run


def _kill_line(objective: str, run: Run, kill: Kill) -> str:
  verdict = "exact" if kill.exact else f"NOT EXACT: {kill.problem}"
  lost = f", checkpoints lost {kill.lost}" if kill.lost else ""
  return (
      f"{objective} (async_checkpointing={str(run.async_checkpointing).lower()}): {kill.moment} kill at step "
      f"{kill.step} +{kill.delay:.4f}s landed {kill.landed!r}; resumed at step {kill.resumed_at} "
      f"({kill.steps_rerun} re-run){lost}: {verdict}"
  )


def plan(rng: random.Random, objective: str, kills: int, steps: int, reference: list[dict]) -> list[Run]:
  """`kills` seeded kills of `objective` grouped into runs (see the module docstring). Delays scale with the
  reference's median step and rollout times (its first step compiles)."""
  timed = [row for row in reference if "learning/loss" in row and row["step"] > 0]
  scale = {
      "step": statistics.median(row["perf/step_time_seconds"] for row in timed),
      "rollout": DECODE_SHARE * statistics.median(row.get("rl/rollout_seconds", 0.0) for row in timed),
      "write": WRITE_SECONDS,
      "commit": 0.0,
      "renamed": 0.0,
  }
  phases = [phase for phase in PHASES if phase != "rollout" or objective in RL_OBJECTIVES]
  drawn = []
  for _ in range(kills):
    moment = rng.choice(PHASES[rng.choice(phases)])
    drawn.append((rng.random() < 0.5, moment, rng.random() * scale[moment]))
  runs = []
  for async_checkpointing in (False, True):
    group = [(moment, delay) for is_async, moment, delay in drawn if is_async == async_checkpointing]
    for start in range(0, len(group), steps):
      chunk = group[start : start + steps]
      at = sorted(rng.sample(range(steps), len(chunk)))
      runs.append(Run(async_checkpointing, [Kill(moment, step, delay) for step, (moment, delay) in zip(at, chunk)]))
  return runs


def summarize(objective: str, runs: list[Run]) -> dict:
  kills = [kill for run in runs for kill in run.kills if kill.landed is not None]
  lost = set()
  for index, run in enumerate(runs):
    lost |= {(index, step) for kill in run.kills for step in kill.lost} | {(index, step) for step in run.unreadable}
  return {
      "objective": objective,
      "kills": len(kills),
      "kills_missed": sum(kill.landed is None for run in runs for kill in run.kills),
      "exact_resumes": sum(kill.exact for kill in kills),
      "checkpoints_lost": len(lost),
      "checkpoints_differ": sum(len(run.checkpoints_differ) for run in runs),
      "steps_rerun": [kill.steps_rerun for kill in kills],
      "phases_hit": dict(collections.Counter(kill.moment for kill in kills)),
      "problems": [problem for run in runs for problem in run.problems],
      "runs": [dataclasses.asdict(run) for run in runs],
  }


def drill(objective: str, kills: int, seed: int, steps: int, workdir: pathlib.Path, *keys: str) -> dict:
  """The objective's SETUP, the reference run and `kills` seeded kills of `objective` under `workdir`; the
  objective's summary."""
  out, cache_dir = workdir / objective, workdir / objective / "jax_cache"
  started = time.perf_counter()
  if objective in SETUP:
    keys = (*keys, *SETUP[objective](out / "setup", *keys))
  reference_started = time.perf_counter()
  reference = reference_run(objective, out / "reference", steps, cache_dir, *keys)
  reference_seconds = time.perf_counter() - reference_started
  runs = plan(random.Random(f"{seed}:{objective}"), objective, kills, steps, reference)
  for index, run in enumerate(runs):
    killed_run(objective, out / f"killed_{index}", run, out / "reference", steps, cache_dir, *keys)
  return summarize(objective, runs) | {
      "reference_seconds": reference_seconds,
      "seconds": time.perf_counter() - started,
  }


def _phases(hit: dict[str, int]) -> str:
  return ", ".join(f"{phase_of(moment)}/{moment} x{n}" for moment, n in sorted(hit.items())) or "-"


def main(argv):
  args = harness.parse(argv)
  objectives = args.flag("objectives", "sft,dpo,grpo").split(",")
  kills, seed, steps = int(args.flag("kills", "5")), int(args.flag("seed", "0")), int(args.flag("steps", "6"))
  output = args.flag("output", "benchmark_drills.json")
  unknown = sorted(set(objectives) - set(OBJECTIVES))
  if unknown:
    raise SystemExit(f"benchmarks.drills: unknown objectives {unknown}; the drills know {sorted(OBJECTIVES)}.")
  workdir = pathlib.Path(args.flag("workdir", "") or tempfile.mkdtemp(prefix="posttrain_drills_"))
  results = [drill(objective, kills, seed, steps, workdir, *args.overrides) for objective in objectives]
  if "workdir" not in args.flags:
    shutil.rmtree(workdir, ignore_errors=True)
  with open(output, "w", encoding="utf-8") as f:
    json.dump({"seed": seed, "steps": steps, "kills_per_objective": kills, "results": results}, f, indent=2)
  header = f"{'objective':<10} {'kills':>5} {'missed':>6} {'exact resumes':>13} {'checkpoints lost':>16}"
  print(f"{header} {'seconds':>8}  phases hit")
  for result in results:
    print(
        f"{result['objective']:<10} {result['kills']:>5} {result['kills_missed']:>6} {result['exact_resumes']:>13} "
        f"{result['checkpoints_lost']:>16} {result['seconds']:>8.0f}  {_phases(result['phases_hit'])}"
    )
  for result in results:
    for problem in result["problems"]:
      print(f"{result['objective']}: {problem}")
  print(f"wrote {os.path.abspath(output)}")
  for result in results:
    print(
        f"drills: objective={result['objective']} kills={result['kills']} exact_resumes={result['exact_resumes']} "
        f"checkpoints_lost={result['checkpoints_lost']}"
    )


if __name__ == "__main__":
  main(sys.argv)

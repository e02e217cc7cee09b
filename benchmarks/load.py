"""Load: a long run of the rollout sampler and of a GRPO loop, watching host memory and XLA compilations.

A run that samples thousands of rollouts must neither grow its host memory step by step (a leak: arrays, rollouts or
metrics kept per step) nor compile after it has run each kind of step once (a recompile: a shape, dtype, sharding or
static argument that changes between calls, which costs seconds each time and fills the executable caches). Two parts
run in one process, each on the config's tiny model (grpo.yml's, 8 prompts x 8 samples, 32 new tokens by default):

- sampler: `rollout.Sampler.sample` called `--sampler_calls` times with the config's prompts per step x
  `rl.num_generations` samples, on random weights, each call with new prompts of random lengths within the largest
  prompt bucket (max_prefill_predict_length / 2 + 1 .. max_prefill_predict_length tokens) and its own key, stopping
  at EOS; warm-up is the first call.
- grpo: `trainer.setup` and `trainer.train` for `--grpo_steps` steps (rollouts, rewards, train steps, and the
  config's held-out evaluations, checkpoints and metric writes); a step samples prompts per step x
  `rl.num_generations` rollouts. Warm-up lasts until the loop has passed the first periodic evaluation and checkpoint
  save after step 0 (`--warmup_steps` overrides it), so it holds one of each kind of step the loop runs.

RSS (psutil's resident set size of the process) is read at the same point of every unit of work, after each sampler call
(its rows fetched to the host) and at the end of each loop step (the objective's `after_step` hook, which
`trainer.train` calls once a step, once the step's train step has finished), against the rollouts sampled so far (calls
or steps times their rows; held-out evaluation rollouts are not counted). Reads at random points, by a timer or while a
train step still runs, catch the step's transient buffers (XLA's temporaries, the rollout batch), which swing RSS by
100-200 MiB on grpo.yml's step. Before each read, glibc's `malloc_trim(0)` hands the free pages malloc keeps back to the
OS (where the C library has it): without it RSS holds the allocator's high-water mark (about 180 MiB more after the GRPO
loop's compilations, given back at some later step or never), which hides a leak smaller than that and makes the curve
jump. The reads after warm-up are cut into 10 consecutive windows, each read as its median (a read now and then sits
20-30 MiB high, with what the allocator or the checkpointer holds at that moment). RSS at the end of warm-up and at the
end are the first and last windows' medians; the slope is the Theil-Sen line's through the medians (the median of the
slopes between every two), in MiB per 1000 rollouts, robust to a window that sits high, and the growth that line's rise
from the first window to the last; the max is the highest read after warm-up. Compilations are counted with JAX's
monitoring event `/jax/core/compile/backend_compile_duration`, which JAX records once per executable it builds (a fresh
XLA compile, or a hit in the persistent compilation cache MaxText enables with `jax_cache_dir`) and never for a call its
jit caches serve. Per part: those RSS figures, and the compilations during and after warm-up (with the names of those
after). Prints a table, writes the rows (with their RSS reads) as JSON and the RSS curves as a PNG, and ends with one
line per part, `load: part=<part> rollouts=<n> rss_growth_mib=<x> compiles_after_warmup=<n>`.

  python -m benchmarks.load [grpo.yml] [key=value ...] [--sampler_calls=2000] [--grpo_steps=300]
      [--warmup_steps=N] [--output=benchmark_load.json] [--plot=benchmark_load.png]
"""

import atexit
from collections.abc import Callable
import ctypes
import ctypes.util
import json
import os
import shutil
import sys
import tempfile

import jax
from jax import monitoring
import matplotlib
import numpy as np
import psutil
from flax import nnx

from maxtext.utils import maxtext_utils
from maxtext.utils import maxtext_utils_nnx
from maxtext.utils import model_creation_utils

from benchmarks import harness
from maxtext_posttrain import config as config_lib
from maxtext_posttrain import rollout
from maxtext_posttrain import trainer
from maxtext_posttrain.data import pipeline

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=wrong-import-position

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
MIB = 2**20
# glibc's malloc_trim, or None where the C library has none (macOS's, musl's).
_MALLOC_TRIM = getattr(ctypes.CDLL(ctypes.util.find_library("c")), "malloc_trim", None)
# The RSS reads after warm-up are cut into this many consecutive windows, each read as its median (module docstring).
WINDOWS = 10


class Monitor:
  """While entered, every compilation with the `progress()` it happened at: (rollouts so far, whether warm-up is
  over); `read()` adds an RSS read."""

  def __init__(self, progress: Callable[[], tuple[int, bool]]):
    self.progress = progress
    self.compiles = []  # (rollouts, warm-up over, function name)
    self.reads = []  # (rollouts, warm-up over, RSS MiB)
    self._process = psutil.Process()

  def _on_duration(self, event: str, duration: float, **kwargs) -> None:
    del duration
    if event == COMPILE_EVENT:
      self.compiles.append((*self.progress(), kwargs.get("fun_name", "?")))

  def read(self) -> None:
    if _MALLOC_TRIM is not None:
      _MALLOC_TRIM(0)
    self.reads.append((*self.progress(), self._process.memory_info().rss / MIB))

  def __enter__(self):
    monitoring.register_event_duration_secs_listener(self._on_duration)
    return self

  def __exit__(self, *exc):
    monitoring.unregister_event_duration_listener(self._on_duration)

  def row(self, part: str, rollouts: int) -> dict:
    """The part's figures (module docstring); RSS in MiB."""
    warm = np.array([(r, mib) for r, is_warm, mib in self.reads if is_warm])
    if len(warm) < 2 * WINDOWS:
      raise ValueError(f"{part}: {len(warm)} RSS reads after warm-up, fewer than {2 * WINDOWS}; run longer.")
    medians = np.array([np.median(w, axis=0) for w in np.array_split(warm, WINDOWS)])
    first, second = np.triu_indices(WINDOWS, 1)
    slope = np.median((medians[second, 1] - medians[first, 1]) / (medians[second, 0] - medians[first, 0]))
    after = [(r, name) for r, is_warm, name in self.compiles if is_warm]
    return {
        "part": part,
        "rollouts": rollouts,
        "warmup_rollouts": int(warm[0, 0]),
        "rss_warm_mib": float(medians[0, 1]),
        "rss_end_mib": float(medians[-1, 1]),
        "rss_max_mib": float(warm[:, 1].max()),
        "rss_growth_mib": float(slope * (medians[-1, 0] - medians[0, 0])),
        "rss_slope_mib_per_1000_rollouts": float(slope * 1000),
        "compiles_warmup": len(self.compiles) - len(after),
        "compiles_after_warmup": len(after),
        "compiled_after_warmup": after,
        "rss_window_medians": medians.tolist(),
        "rss_reads": self.reads,
    }


def _config(args: harness.Args, steps: int):
  """The config file's model and run, writing nowhere that outlives the process, plus the command line's keys."""
  workdir = tempfile.mkdtemp(prefix="posttrain_bench_load_")
  atexit.register(shutil.rmtree, workdir, ignore_errors=True)
  return config_lib.initialize(
      ["", args.config_file, "run_name=load", f"base_output_directory={workdir}", f"steps={steps}", *args.overrides]
  )


def sampler_load(config, calls: int) -> dict:
  """`calls` sampler calls of prompts per step x num_generations rows on random weights (module docstring)."""
  mesh = maxtext_utils.get_mesh_from_config(config)
  create_model, abstract_model = model_creation_utils.create_nnx_abstract_model(config, mesh)
  params = nnx.state(maxtext_utils_nnx.create_nnx_sharded_model(abstract_model, create_model, mesh), nnx.Param)
  sampler = rollout.Sampler(config, mesh)
  sampling = rollout.SamplingParams.from_config(config)
  eos_id = pipeline.Encoder.from_config(config).tokenizer.eos_id
  num_prompts, num_samples = config.global_batch_size_to_train_on, config.rl.num_generations
  longest, rng = config.max_prefill_predict_length, np.random.default_rng(0)
  done = 0
  with Monitor(lambda: (done * num_prompts * num_samples, done > 0)) as monitor:
    for call in range(calls):
      lengths = rng.integers(longest // 2 + 1, longest + 1, num_prompts)
      prompts = [rng.integers(3, config.vocab_size, size=n).tolist() for n in lengths]
      sampler.sample(
          params,
          prompts,
          config_lib.max_new_tokens(config),
          eos_id,
          jax.random.key(call),
          sampling,
          num_samples=num_samples,
      )
      done = call + 1
      monitor.read()
  return monitor.row("sampler", done * num_prompts * num_samples)


def default_warmup_steps(config) -> int:
  """The loop's step after which it has run a periodic evaluation and a checkpoint save past step 0, or 1 step."""
  save = config.checkpoint_period + 1 if config.enable_checkpointing else 0
  return max(1, config.eval_interval, save)


def grpo_load(config, warmup_steps: int | None) -> dict:
  """`trainer.train` of `config` (its `steps`), RSS read at the end of every step; warm-up until `loop.step` passes
  `warmup_steps`."""
  warmup_steps = default_warmup_steps(config) if warmup_steps is None else warmup_steps
  if config.steps <= warmup_steps + 1:
    raise ValueError(
        f"--grpo_steps={config.steps} leaves no steps after warm-up ({warmup_steps} steps: to the first periodic "
        "evaluation and checkpoint save; --warmup_steps sets it)."
    )
  loop = trainer.setup(config)
  rows = config.global_batch_size_to_train_on * config.rl.num_generations
  with Monitor(lambda: (loop.step * rows, loop.step > warmup_steps)) as monitor:
    after_step = loop.objective.after_step

    def after_step_and_read(loop, step, metrics):
      after_step(loop, step, metrics)
      jax.block_until_ready(metrics)  # the train step done, its temporaries freed
      monitor.read()

    loop.objective.after_step = after_step_and_read
    trainer.train(loop)
  return monitor.row("grpo", loop.step * rows) | {"steps": loop.step, "warmup_steps": warmup_steps}


def plot(rows: list[dict], png_path: str) -> None:
  """RSS over rollouts per part: every read (warm-up dotted) and the window medians the figures read."""
  fig, axes = plt.subplots(1, len(rows), figsize=(5.5 * len(rows), 4), squeeze=False)
  for ax, row in zip(axes[0], rows):
    for warm, style in ((False, ":"), (True, "-")):
      points = [(r, mib) for r, is_warm, mib in row["rss_reads"] if is_warm == warm]
      if points:
        ax.plot(*zip(*points), style, linewidth=0.7, label="after warm-up" if warm else "warm-up")
    ax.plot(*zip(*row["rss_window_medians"]), "o-", label=f"median of each of {WINDOWS} windows")
    title = f"{row['part']}: {row['compiles_after_warmup']} compiles after warm-up"
    ax.set(xlabel="rollouts", ylabel="RSS (MiB)", title=title)
    ax.legend()
  fig.tight_layout()
  fig.savefig(png_path, dpi=110)
  plt.close(fig)


def main(argv):
  args = harness.parse(argv, default_config="grpo.yml")
  sampler_calls, grpo_steps = int(args.flag("sampler_calls", "2000")), int(args.flag("grpo_steps", "300"))
  warmup_steps = int(args.flags["warmup_steps"]) if "warmup_steps" in args.flags else None
  output, png_path = args.flag("output", "benchmark_load.json"), args.flag("plot", "benchmark_load.png")
  config, rows = _config(args, grpo_steps), []
  if sampler_calls:
    rows.append(sampler_load(config, sampler_calls))
  if grpo_steps:
    rows.append(grpo_load(config, warmup_steps))
  columns = ("rollouts", "rss_warm_mib", "rss_end_mib", "rss_max_mib", "rss_growth_mib")
  columns += ("rss_slope_mib_per_1000_rollouts", "compiles_warmup", "compiles_after_warmup")
  print(f"{'part':>8} " + " ".join(f"{c:>{max(len(c), 9)}}" for c in columns))
  for row in rows:
    cells = (f"{row[c]:.1f}" if isinstance(row[c], float) else str(row[c]) for c in columns)
    print(f"{row['part']:>8} " + " ".join(f"{cell:>{max(len(c), 9)}}" for c, cell in zip(columns, cells)))
    for rollouts, name in row["compiled_after_warmup"]:
      print(f"  {row['part']} compiled {name} after warm-up, at {rollouts} rollouts")
  with open(output, "w", encoding="utf-8") as f:
    json.dump(rows, f, indent=2)
  plot(rows, png_path)
  print(f"wrote {os.path.abspath(output)} and {os.path.abspath(png_path)}")
  for row in rows:
    print(
        f"load: part={row['part']} rollouts={row['rollouts']} rss_growth_mib={row['rss_growth_mib']:.1f} "
        f"compiles_after_warmup={row['compiles_after_warmup']}"
    )
  return rows


if __name__ == "__main__":
  main(sys.argv)

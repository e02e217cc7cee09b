"""`python -m maxtext_posttrain.compile`: every program of a run compiled ahead of time for a TPU slice on this CPU
host (libtpu compiles for MaxText's v5p-8 topology, 4 chips), with per-chip memory, and XLA's out-of-memory error for
a model that cannot fit. The tiny bundled model compiles in seconds per program; the file takes about 60 s."""

import json
import os
import subprocess
import sys

import pytest

from maxtext_posttrain import compile as compile_lib
from maxtext_posttrain import config as posttrain_config
from tests import paths

# libtpu takes a host-wide lock in a process that loads it without this, and then no other process can load it: not
# the command this file starts, nor another pytest-xdist worker compiling for a topology (test_sampling.py). There are
# no chips to guard here, so this process and its children share it (set before this process loads libtpu).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

TOPOLOGY = ("compile_topology=v5p-8", "compile_topology_num_slices=1")
# One row per chip: XLA's TPU compile time grows with the buffers it schedules (the GRPO step of grpo.yml's 256 rows
# compiles in about 7x the time of these 8).
SMALL = ("per_device_batch_size=1", "eval_generation_examples=4")

# MaxText's persistent compilation cache (jax_cache_dir) keeps TPU programs of earlier runs, which a host without a TPU
# client cannot load back; jax says so and compiles again.
pytestmark = pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry:UserWarning")


def _argv(out, config_file: str, *keys: str) -> list[str]:
  return [config_file, "run_name=compile", f"base_output_directory={out}", *TOPOLOGY, *keys]


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
  """sft.yml's programs and MaxText's pretraining step, compiled once for the module."""
  config = posttrain_config.initialize(["", *_argv(tmp_path_factory.mktemp("sft"), "sft.yml", *SMALL)])
  return compile_lib.compile_run(config, compare_pretraining=True)


@pytest.fixture(scope="module")
def grpo(tmp_path_factory):
  """grpo.yml with a KL term, so with the frozen reference and its forward, and a tool, so with the later turns'
  sampler; the pass@k evaluation samples as the rollouts do (same prompts, samples and settings), so it runs the
  rollout's programs."""
  keys = ("rl.grpo_beta=0.04", "rl.num_generations=2", "eval_samples_per_prompt=2", "eval_pass_at_k=[1,2]")
  keys += ("rl.tools=[calculator]",)
  argv = _argv(tmp_path_factory.mktemp("grpo"), "grpo.yml", *SMALL, *keys)
  return compile_lib.compile_run(posttrain_config.initialize(["", *argv]))


def _check_sizes(memories: list[compile_lib.Memory]) -> None:
  for m in memories:
    assert m.error is None, m
    assert min(m.arguments, m.outputs, m.temporaries, m.code) > 0, m
    assert m.resident >= m.kept + m.temporaries, m


def test_sft_compiles_its_steps_and_evaluation_decode(sft, capsys):
  run, memories = sft
  assert [m.program for m in memories] == [
      "policy train step",
      "policy eval step",
      "evaluation greedy decode",
      compile_lib.PRETRAINING,
  ]
  _check_sizes(memories)
  assert run.mesh.devices.size == 4 and compile_lib.hbm_bytes(run.mesh) == int(95.73 * compile_lib.GIB)
  assert set(run.kept) == {"policy weights", "policy optimizer"}
  train, *_, pretraining = memories
  assert train.aliased > 0  # the donated state is updated in place, as in MaxText's step
  assert pretraining.kept == sum(run.kept.values())  # the same state, counted the same way
  # No more temporaries than MaxText's own step, whose cross entropy SFT's is (on real vocabularies the autodiffed
  # logsumexp and gather cost 0.5 GiB per chip more for llama3.1-8b on v5p-256; test_losses.py guards the cause).
  assert train.temporaries <= 1.05 * pretraining.temporaries, (train, pretraining)
  compile_lib.report(run, memories)
  rows = [
      json.loads(line.split(" ", 1)[1]) for line in capsys.readouterr().out.splitlines() if line.startswith("compile")
  ]
  assert [row["program"] for row in rows] == [m.program for m in memories]
  assert all(row["fits"] and row["resident"] > row["temporaries"] > 0 for row in rows)


def test_grpo_compiles_the_sampler_and_the_reference_forward(grpo):
  run, memories = grpo
  programs = ["rollout sampler", "rollout sampler, later tool turns", "reference forward", "policy train step"]
  assert [m.program for m in memories] == programs
  _check_sizes(memories)
  assert set(run.kept) == {"policy weights", "policy optimizer", "reference weights"}
  # The reference is sharded as the policy is, not replicated on every chip.
  assert run.kept["reference weights"] == run.kept["policy weights"]
  sampler, later_turns, reference, _ = memories
  assert sampler.kept == later_turns.kept == reference.kept == sum(run.kept.values()) and sampler.inputs == 0


def test_the_reference_on_the_samplers_devices_compiles_on_the_decoded_rollouts(tmp_path):
  """rl.reference_devices=sampler: the reference's forward reads the decode program's arrays (`Sampler.abstract_arrays`),
  and its program is fit-checked in place of the one on the training rows."""
  keys = ("rl.grpo_beta=0.04", "rl.num_generations=2", "rl.reference_devices=sampler", "eval_interval=0")
  run = compile_lib.build(posttrain_config.initialize(["", *_argv(tmp_path, "grpo.yml", *SMALL, *keys)]))
  programs = compile_lib._rollout_programs(run)  # pylint: disable=protected-access
  assert [p.name for p in programs] == ["rollout sampler", "reference forward, on the decoded rollouts"]
  memory = compile_lib.measure(programs[1])
  _check_sizes([memory])
  assert memory.kept == sum(run.kept.values()) and run.kept["reference weights"] == run.kept["policy weights"]


def test_a_program_that_fits_only_alone_fails():
  """XLA checks each program alone; the run also keeps its other states on the chip."""
  hbm = 10 * compile_lib.GIB
  fits = compile_lib.Memory("policy train step", kept=4 * compile_lib.GIB, inputs=0, temporaries=5 * compile_lib.GIB)
  over = compile_lib.Memory("reference forward", kept=8 * compile_lib.GIB, inputs=0, temporaries=3 * compile_lib.GIB)
  assert compile_lib.failure([fits], hbm, "TPU v5") is None
  problem = compile_lib.failure([fits, over], hbm, "TPU v5")
  assert problem.startswith("The reference forward fits alone but not beside what the run keeps resident: 11.00 GiB")


def test_an_oversize_model_fails_with_xlas_out_of_memory_error(tmp_path):
  """A 2-layer model with a 2^26-wide MLP (about 51 GiB of float32 weights per v5p chip, three times that with Adam's
  moments): the command ends with XLA's own message on one line, exit status 1, no traceback."""
  argv = _argv(tmp_path, "sft.yml", "base_mlp_dim=67108864", "eval_interval=0")
  completed = subprocess.run(
      [sys.executable, "-m", "maxtext_posttrain.compile", *argv],
      cwd=tmp_path,
      env=dict(os.environ, PYTHONPATH=str(paths.REPO)),
      capture_output=True,
      text=True,
      timeout=600,
      check=False,
  )
  assert completed.returncode == 1, completed.stderr[-2000:]
  last = completed.stderr.strip().splitlines()[-1]
  assert last.startswith(
      "maxtext_posttrain.compile: error: Failure: The policy train step does not fit a TPU v5 chip: RESOURCE_EXHAUSTED"
  ), last
  assert "CompileTimeHbmOom" in last and "Traceback" not in completed.stderr
  summary = json.loads(completed.stdout.strip().splitlines()[-1].split(" ", 1)[1])
  assert summary["program"] == "policy train step" and not summary["fits"] and "CompileTimeHbmOom" in summary["error"]

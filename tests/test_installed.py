"""The package as a user installs it: the built wheel in a fresh virtual environment, run from an empty directory.

The wheel is installed with `--no-deps` into a new venv whose only other packages are this environment's pinned set
(reached through a `.pth` line, so nothing is downloaded or installed twice); the checkout is not on the path, so
the bundled configs, tokenizer and data builders must come from the wheel. The tiny demo then runs there, and the
commands it prints to evaluate and sample its RL model are run as printed.
"""

import json
import os
import pathlib
import shlex
import subprocess
import sys
import sysconfig

import pytest

from tests import paths


def _run(command: list[str], cwd: pathlib.Path, env: dict[str, str]) -> subprocess.CompletedProcess:
  completed = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900, check=False)
  assert completed.returncode == 0, (command, completed.stdout[-2000:], completed.stderr[-4000:])
  return completed


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
  """{"python": the fresh venv's interpreter, "cwd": an empty directory, "env": the environment to run in}."""
  root = tmp_path_factory.mktemp("installed")
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
  env["HOME"] = str(root / "home")  # the bundled configs' ~/.cache data directory, kept inside the test
  build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(root / "dist")]
  _run([*build, str(paths.REPO)], root, env)
  (wheel,) = (root / "dist").glob("maxtext_posttrain-*.whl")
  venv = root / "venv"
  _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], root, env)
  python = venv / "bin" / "python"
  site = subprocess.run(
      [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
      capture_output=True,
      text=True,
      check=True,
  ).stdout.strip()
  pathlib.Path(site, "pinned_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
  _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)], root, env)
  cwd = root / "empty"
  cwd.mkdir()
  located = _run([python, "-c", "import maxtext_posttrain; print(maxtext_posttrain.__file__)"], cwd, env)
  assert located.stdout.strip().startswith(site), located.stdout  # the wheel's copy, not the checkout
  return {"python": str(python), "cwd": cwd, "env": env, "root": root}


def test_the_wheel_trains_from_an_empty_directory_with_a_bundled_config(installed):
  out = installed["root"] / "sft_out"
  completed = _run(
      [installed["python"], "-m", "maxtext_posttrain.train", "sft.yml", "run_name=wheel", f"base_output_directory={out}"]
      + ["steps=3", "eval_interval=0", "per_device_batch_size=4", "checkpoint_period=1000", "async_checkpointing=false"],
      installed["cwd"],
      installed["env"],
  )
  assert "[train] step 3/3" in completed.stderr
  assert "[transformers]" not in completed.stderr  # transformers' PyTorch advice is noise here
  assert (out / "wheel" / "checkpoints" / "2" / "items").is_dir()
  assert not list(installed["cwd"].iterdir())  # nothing written where the command ran


def test_the_tiny_demo_saves_its_rl_model_and_its_printed_commands_work(installed):
  """The demo from the wheel; then its evaluate command reproduces the table's RL column and its sample command
  samples the saved RL model."""
  out = installed["root"] / "demo_out"
  demo = _run(
      [installed["python"], "-m", "maxtext_posttrain.demo", "--sft_steps=2", f"--output_dir={out}"]
      + ["steps=2", "eval_interval=2", "per_device_batch_size=2", "rl.num_generations=2"]
      + ["eval_generation_examples=4", "eval_samples_per_prompt=2", "eval_pass_at_k=[1,2]"],
      installed["cwd"],
      installed["env"],
  )
  lines = demo.stdout.splitlines()
  assert any(line.startswith("pass@1 ") and "±" in line for line in lines), demo.stdout
  evaluate_command = lines[lines.index("Evaluate it (the table's last column again):") + 1].strip()
  sample_command = lines[lines.index("Sample from it:") + 1].strip()
  assert (out / "demo_grpo" / "checkpoints" / "1" / "items").is_dir()

  def run_printed(command: str) -> subprocess.CompletedProcess:
    argv = shlex.split(command)
    assert argv[:2] == ["python", "-m"], command
    return _run([installed["python"], *argv[1:]], installed["cwd"], installed["env"])

  evaluated = json.loads(run_printed(evaluate_command).stdout.strip().splitlines()[-1])
  rows = [json.loads(line) for line in (out / "demo_grpo_metrics.jsonl").read_text().splitlines()]
  (last_eval,) = [r for r in rows if "eval/pass_at_1" in r and int(r["step"]) == 2]
  for name in ("pass_at_1", "pass_at_2", "maj_at_2", "format_accuracy", "partial_accuracy"):
    assert evaluated[name] == pytest.approx(last_eval[f"eval/{name}"], abs=1e-9), name
  printed = run_printed(sample_command).stdout.splitlines()
  samples = [json.loads(line) for line in printed if line.startswith("{")]  # MaxText prints [NO-OP] notes there too
  assert [s["sample"] for s in samples] == [0, 1, 2, 3] and all("text" in s for s in samples)

"""The same steps on 1 device and on 4 fake CPU devices agree: SFT (fsdp x tensor, and MaxText's pipeline), GRPO, PPO
and distillation (off- and on-policy)."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from tests import paths
from tests import multidevice_distill
from tests import multidevice_losses
from tests import multidevice_rl
from tests import run_utils

STEPS = 3
# Same global batch (16) everywhere, and one learning-rate schedule independent of `steps`.
COMMON = ["learning_rate_schedule_steps=8"]
LAYOUTS = [
    ["per_device_batch_size=4", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", *COMMON],
    ["per_device_batch_size=4", "ici_pipeline_parallelism=2", "ici_data_parallelism=2", *COMMON],
]


FSDP_X_TENSOR = ["per_device_batch_size=1", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"]
# Unscanned layers, as tests/test_multiprocess.py runs RL on 4 fake devices: with scanned ones XLA:CPU now and then
# deadlocks a program on the trainer's two devices (one device thread waits in an all-reduce, the other in an
# all-gather of the same execution; seen once in PPO's run), where a TPU runs a program's collectives in order.
AHEAD = ["rl.off_policy_steps=1", "enable_checkpointing=false", "scan_layers=false"]
# Where the split runs' reference scores: GRPO's on the trainer's devices, PPO's on the sampler's (the decoded rollouts).
REFERENCE_DEVICES = {"grpo.yml": "trainer", "ppo.yml": "sampler"}


@pytest.fixture(scope="module")
def four_devices(tmp_path_factory, tfds_dir, sft_checkpoint, deep_sft_checkpoint) -> subprocess.CompletedProcess:
  """The sharded runs of this module's tests, run in one subprocess with 4 fake CPU devices (tests/on_four_devices.py),
  which prints one JSON line per job."""
  root, tfds = tmp_path_factory.mktemp("four_devices"), str(tfds_dir)
  jobs = [
      ["sft", "tests.multidevice_losses", "layouts_losses", [str(root / "sft"), tfds, STEPS, LAYOUTS]],
      ["grpo", "tests.multidevice_rl", "run", [str(root / "grpo"), tfds, FSDP_X_TENSOR, "multidevice"]],
      ["ppo", "tests.multidevice_rl", "run", [str(root / "ppo"), tfds, FSDP_X_TENSOR, "multidevice", "ppo.yml"]],
      *(
          [f"{config_file}_ahead", "tests.multidevice_rl", "run"]
          + [
              [
                  str(root / config_file),
                  tfds,
                  [*AHEAD, "per_device_batch_size=1", f"rl.reference_devices={REFERENCE_DEVICES[config_file]}"],
                  "multidevice",
                  config_file,
              ]
          ]
          for config_file in ("grpo.yml", "ppo.yml")
      ),
      [
          "distill",
          "tests.multidevice_distill",
          "run_all",
          [str(root / "distill"), tfds, str(sft_checkpoint), str(deep_sft_checkpoint), FSDP_X_TENSOR],
      ],
  ]
  for job in jobs:
    pathlib.Path(job[3][0]).mkdir()  # each job's output directory
  env = dict(os.environ, XLA_FLAGS=run_utils.xla_flags(4), PYTHONPATH=str(paths.REPO))
  return subprocess.run(
      [sys.executable, str(paths.REPO / "tests" / "on_four_devices.py"), json.dumps(jobs)],
      env=env,
      capture_output=True,
      text=True,
      timeout=1800,
      check=False,
  )


def _sharded(four_devices: subprocess.CompletedProcess, job: str):
  """What the sharded run `job` returned. A job that raised fails its own test with its traceback; a subprocess that
  did not exit cleanly fails them all with its stderr."""
  assert four_devices.returncode == 0, four_devices.stderr[-4000:]
  lines = [json.loads(line) for line in four_devices.stdout.splitlines() if line.startswith("{")]
  (line,) = [line for line in lines if line["job"] == job]
  assert "error" not in line, line["error"]
  return line["result"]


def test_one_device_and_four_device_meshes_give_the_same_losses(tmp_path, tfds_dir, four_devices):
  single, _ = multidevice_losses.first_losses(
      str(tmp_path), str(tfds_dir), STEPS, ["per_device_batch_size=16", *COMMON], "single"
  )
  results = _sharded(four_devices, "sft")
  assert [r["overrides"] for r in results] == LAYOUTS
  assert results[0]["mesh"]["fsdp"] == 2 and results[0]["mesh"]["tensor"] == 2
  assert results[1]["mesh"]["stage"] == 2
  for result in results:
    np.testing.assert_allclose(result["losses"], single["losses"], rtol=2e-5, err_msg=str(result["overrides"]))


def test_rl_steps_on_one_device_and_on_fsdp_x_tensor_agree(tmp_path, tfds_dir, four_devices):
  """GRPO on 4 fake devices (fsdp 2 x tensor 2; per_device_batch_size 1, the same 4 prompts): the sampler draws the
  same completions (rewards equal), and losses and KL match the single device's."""
  single = multidevice_rl.run(str(tmp_path), str(tfds_dir), [], "single")
  sharded = _sharded(four_devices, "grpo")
  assert sharded["mesh"]["fsdp"] == 2 and sharded["mesh"]["tensor"] == 2
  assert sharded["rewards"] == single["rewards"] and len(single["rewards"]) == 3
  np.testing.assert_allclose(sharded["losses"], single["losses"], rtol=1e-4, atol=1e-7)
  np.testing.assert_allclose(sharded["kl"], single["kl"], rtol=1e-4, atol=1e-7)


def test_ppo_steps_on_one_device_and_on_fsdp_x_tensor_agree(tmp_path, tfds_dir, four_devices):
  """PPO (policy, critic and reference) on 4 fake devices (fsdp 2 x tensor 2) against one device: the same
  completions (rewards equal), and policy losses, value losses, KL and the critic's explained variance match."""
  single = multidevice_rl.run(str(tmp_path), str(tfds_dir), [], "single", "ppo.yml")
  sharded = _sharded(four_devices, "ppo")
  assert sharded["mesh"]["fsdp"] == 2 and sharded["mesh"]["tensor"] == 2
  assert sharded["rewards"] == single["rewards"] and len(single["rewards"]) == 3
  for key in ("losses", "value_losses", "explained_variance"):
    np.testing.assert_allclose(sharded[key], single[key], rtol=1e-4, atol=1e-6, err_msg=key)
  # The first step's KL is 0 up to float32 rounding: the sampler's and the reference's log-probs of the same weights
  # come from two programs, and PPO sums their differences over each completion's tokens (on an Intel Xeon host:
  # -3.0e-7 on 4 devices, -1.4e-6 on one).
  np.testing.assert_allclose(sharded["kl"], single["kl"], rtol=1e-4, atol=1e-5, err_msg="kl")


@pytest.mark.parametrize("config_file", ["grpo.yml", "ppo.yml"])
def test_sampling_ahead_on_a_rollout_mesh_of_its_own_agrees_with_one_shared_device(
    tmp_path, tfds_dir, config_file, four_devices
):
  """rl.off_policy_steps=1 with MaxText's halves on 4 fake devices (trainer on devices 0-1, sampler on 2-3, the
  weights copied across after every step; PPO's reference on the sampler's devices, `REFERENCE_DEVICES`) against the
  same run on one device shared by trainer and sampler, its reference on the trainer's: the same rollouts (rewards
  equal), KL and losses, one update stale after the first step."""
  single = multidevice_rl.run(
      str(tmp_path), str(tfds_dir), [*AHEAD, "trainer_devices_fraction=1", "sampler_devices_fraction=1"], "single",
      config_file,
  )  # fmt: skip
  split = _sharded(four_devices, f"{config_file}_ahead")
  assert (split["trainer_devices"], split["rollout_devices"]) == ([0, 1], [2, 3])
  assert split["staleness"] == single["staleness"] == [0, 1, 1]
  assert split["rewards"] == single["rewards"]
  # PPO's first loss is ~1e-6, what is left when terms of whitened advantages cancel: float32 summation order shows.
  np.testing.assert_allclose(split["losses"], single["losses"], rtol=1e-4, atol=2e-6)
  np.testing.assert_allclose(split["kl"], single["kl"], rtol=1e-4, atol=1e-5)


def test_distillation_steps_on_one_device_and_on_fsdp_x_tensor_agree(
    tmp_path, tfds_dir, sft_checkpoint, deep_sft_checkpoint, four_devices
):
  """distill.yml (a moving alpha, T 2, feature and attention transfer through a learned feature map) and
  distill_on_policy.yml (on- and off-policy steps) with the 4-layer teacher read inside the step, on 4 fake devices
  (fsdp 2 x tensor 2) against one: the losses, divergences and feature losses match."""
  paths_ = [str(tmp_path), str(tfds_dir), str(sft_checkpoint), str(deep_sft_checkpoint)]
  single = multidevice_distill.run_all(*paths_, ["per_device_batch_size=4"])
  sharded = _sharded(four_devices, "distill")
  assert [r["config"] for r in sharded] == list(multidevice_distill.CONFIGS)
  for one, four in zip(single, sharded):
    assert four["mesh"]["fsdp"] == 2 and four["mesh"]["tensor"] == 2 and len(one["losses"]) == 3
    for key in ("losses", "divergence", "feature_loss"):
      np.testing.assert_allclose(four[key], one[key], rtol=1e-4, atol=1e-6, err_msg=f"{one['config']} {key}")

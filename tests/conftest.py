"""Shared fixtures: tiny configs over the bundled arithmetic data, built once per session."""

import pathlib

import pytest


@pytest.fixture(scope="session")
def tfds_dir(tmp_path_factory) -> pathlib.Path:
  """One TFDS data_dir per session; the arithmetic builder is prepared into it on first use."""
  return tmp_path_factory.mktemp("tfds")


@pytest.fixture
def make_config(tmp_path, tfds_dir):
  """`make_config(key=value, ...)` -> a PostTrainConfig from a bundled config (sft.yml unless `config_file` names
  another, or a yml path), writing under this test's tmp dir."""
  from maxtext_posttrain import config as posttrain_config  # pylint: disable=import-outside-toplevel

  def build(*overrides: str, config_file: str = "sft.yml", run_name: str = "run"):
    argv = ["", config_file, f"run_name={run_name}", f"base_output_directory={tmp_path}"]
    argv += [f"dataset_path={tfds_dir}", *overrides]
    return posttrain_config.initialize(argv)

  return build


@pytest.fixture(scope="session")
def sft_run(tmp_path_factory, tfds_dir):
  """A seeded 200-step SFT run on the bundled arithmetic data, evaluated at steps 0 and 200: the SFT learning test
  reads its curve, and its params are the usual starting point of preference tuning and RL."""
  from maxtext_posttrain import config as posttrain_config  # pylint: disable=import-outside-toplevel
  from tests import run_utils  # pylint: disable=import-outside-toplevel

  out = tmp_path_factory.mktemp("sft")
  argv = ["", "sft.yml", "run_name=sft", f"base_output_directory={out}", f"dataset_path={tfds_dir}"]
  argv += ["steps=200", "eval_interval=200", "eval_generation_examples=64", "checkpoint_period=1000"]
  argv += ["async_checkpointing=false", f"metrics_file={out / 'metrics.jsonl'}"]
  _, summary = run_utils.run(posttrain_config.initialize(argv))
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

  out = tmp_path_factory.mktemp("deep_sft")
  argv = ["", "sft.yml", "run_name=sft", f"base_output_directory={out}", f"dataset_path={tfds_dir}", "steps=200"]
  argv += [f"base_num_decoder_layers={run_utils.DEEP_SFT_LAYERS}", "eval_interval=0", "checkpoint_period=1000"]
  argv += ["async_checkpointing=false"]
  run_utils.run(posttrain_config.initialize(argv))
  return out / "sft" / "checkpoints" / "199" / "items"

"""The entry point as a MaxText user runs it: our yml, or MaxText's own base.yml plus `posttrain_mode`."""

import json
import os
import subprocess
import sys
import types

import pytest

from maxtext_posttrain import trainer
from tests import paths


def _python_module(module: str, *args: str, cwd) -> subprocess.CompletedProcess:
  """`python -m <module> args` in a fresh interpreter, from `cwd`, with the repository importable."""
  return subprocess.run(
      [sys.executable, "-m", module, *args],
      cwd=cwd,
      env=dict(os.environ, PYTHONPATH=str(paths.REPO)),
      capture_output=True,
      text=True,
      timeout=600,
      check=False,
  )


def _train(*args, cwd):
  return _python_module("maxtext_posttrain.train", *args, cwd=cwd)


def test_train_module_on_maxtexts_base_yml(tmp_path, tfds_dir):
  """MaxText's installed base.yml + `posttrain_mode=sft` + data/model keys on the command line, from any cwd."""
  completed = _train(
      paths.MAXTEXT_BASE_YML,
      "posttrain_mode=sft",
      "run_name=cli",
      f"base_output_directory={tmp_path}",
      "skip_jax_distributed_system=true",
      "dataset_type=grain",
      "grain_file_type=tfds",
      "grain_train_files=arithmetic_word_problems/easy",
      f"dataset_path={tfds_dir}",
      "train_data_columns=[question,answer]",
      "tokenizer_type=sentencepiece",
      "tokenizer_path=maxtext_posttrain/assets/arithmetic.model",
      "vocab_size=512",
      "base_emb_dim=64",
      "base_num_query_heads=2",
      "base_num_kv_heads=2",
      "head_dim=32",
      "base_mlp_dim=128",
      "base_num_decoder_layers=2",
      "max_target_length=128",
      "attention=dot_product",
      "per_device_batch_size=4",
      "steps=3",
      "eval_interval=0",
      "use_sft=true",
      "sft_train_on_completion_only=true",
      "packing=true",
      "grain_worker_count=0",
      f"metrics_file={tmp_path / 'metrics.jsonl'}",
      cwd=tmp_path,
  )
  assert completed.returncode == 0, completed.stderr[-4000:]
  assert "[train] step 3/3" in completed.stderr
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [int(r["step"]) for r in rows if "learning/loss" in r] == [0, 1, 2]
  (data_row,) = [r for r in rows if "data/train/num_examples" in r]
  assert data_row["data/train/num_examples"] == 20000 and data_row["data/train/num_truncated"] == 0
  manifest = json.loads((tmp_path / "cli" / "manifest.json").read_text())
  assert manifest["posttrain_mode"] == "sft"
  assert len(manifest["data"]["train"]["fingerprint"]) == 64
  assert manifest["packages"]["maxtext"] == "0.2.5"
  assert manifest["seeds"] == {"init_weights_seed": 0, "data_shuffle_seed": 0}
  assert manifest["config"]["base_emb_dim"] == 64
  assert (tmp_path / "cli" / "checkpoints" / "2").is_dir()
  assert list((tmp_path / "cli" / "tensorboard").rglob("events.out.tfevents.*"))


def test_unknown_posttrain_mode_lists_the_registered_modes(make_config):
  """The config keeps no list of modes (objectives register themselves); the loop's setup refuses an unknown one
  before it builds anything."""
  with pytest.raises(ValueError, match=r"Unknown posttrain_mode 'grpoo'\. Registered modes: .*sft"):
    trainer.setup(make_config("posttrain_mode=grpoo"))


def test_unknown_key_is_named_with_the_closest_valid_keys(make_config):
  with pytest.raises(ValueError, match=r"'sft_train_on_completion_onyl' on the command line: did you mean "):
    make_config("sft_train_on_completion_onyl=true")
  # Keys of a section (`rl:`, `lora:`, `dpo:`), which pydantic would drop silently, are checked too.
  with pytest.raises(ValueError, match=r"'rl\.num_generatons' on the command line: did you mean 'rl\.num_generations'"):
    make_config("rl.num_generatons=4", config_file="grpo.yml")
  with pytest.raises(ValueError, match=r"'lora\.lora_rnk' on the command line: did you mean 'lora\.lora_rank'\?"):
    make_config("lora.lora_rnk=4")


def test_an_unknown_key_in_a_yml_names_the_file_and_line(make_config, tmp_path):
  config_file = tmp_path / "mine.yml"
  config_file.write_text(f"base_config: {paths.BUNDLED_CONFIGS / 'sft.yml'}\nsteps: 3\nlearning_rat: 0.1\n")
  with pytest.raises(ValueError, match=rf"'learning_rat' in {config_file} line 3: did you mean 'learning_rate'\?"):
    make_config(config_file=str(config_file))


def _last_line(completed) -> str:
  return completed.stderr.strip().splitlines()[-1]


def _train_in_turn(*command_lines: tuple[str, ...], cwd) -> list[types.SimpleNamespace]:
  """Each command line's `returncode` and `stderr`, run in turn in one fresh interpreter (tests/commands_in_turn.py)."""
  completed = _python_module("tests.commands_in_turn", json.dumps(command_lines), cwd=cwd)
  assert completed.returncode == 0, completed.stderr[-4000:]
  return [types.SimpleNamespace(**ended) for ended in json.loads(completed.stdout.splitlines()[-1])]


def test_user_errors_end_in_one_line_at_the_command_line(tmp_path):
  """A mistyped key, a bad value, a missing config, keys that cannot go together: exit status 1 and a last line that
  says what is wrong, without MaxText's list of every valid key; an error after the run is built keeps its traceback
  above that line."""
  common = ("run_name=x", f"base_output_directory={tmp_path}")
  typo, value, missing, clash, data = _train_in_turn(
      ("sft.yml", *common, "learning_rat=0.1"),
      ("sft.yml", *common, "learning_rate=abc"),
      ("configs/nope.yml", *common),
      ("grpo.yml", *common, "rl.loss_algo=gspo", "rl.dual_clip=3.0"),  # found by the objective
      ("sft.yml", *common, "grain_file_type=jsonl", "grain_train_files=/nowhere/*.jsonl"),
      cwd=tmp_path,
  )
  assert typo.returncode == 1
  assert _last_line(typo) == (
      "maxtext_posttrain.train: error: ValueError: Unknown config key 'learning_rat' on the command line: did you mean "
      "'learning_rate'? Valid keys are MaxText's (its base.yml and configs/types.py) plus those of "
      "maxtext_posttrain/config.py."
  )
  assert "'mlp_dim'" not in typo.stderr and "Traceback" not in typo.stderr

  assert value.returncode == 1
  assert _last_line(value) == (
      "maxtext_posttrain.train: error: ValidationError: learning_rate='abc': Input should be a valid number, unable to "
      "parse string as a number"
  )

  assert missing.returncode == 1
  assert _last_line(missing).startswith(
      "maxtext_posttrain.train: error: FileNotFoundError: Config file 'configs/nope.yml' does not exist"
  )
  bundled = sorted(
      f for f in os.listdir(os.path.join(os.path.dirname(trainer.__file__), "configs")) if f.endswith(".yml")
  )
  assert "distill.yml" in bundled and "sft.yml" in bundled
  assert f"bundled config: {', '.join(bundled)}." in _last_line(missing)

  assert clash.returncode == 1 and "Traceback" not in clash.stderr
  assert _last_line(clash) == (
      "maxtext_posttrain.train: error: ConfigError: rl.dual_clip applies to rl.loss_algo=grpo, not gspo."
  )

  assert data.returncode == 1
  assert "Traceback" in data.stderr
  assert _last_line(data) == "maxtext_posttrain.train: error: ValueError: No JSONL file matches '/nowhere/*.jsonl'."


def test_unknown_mode_exits_nonzero_from_the_command_line(tmp_path):
  completed = _train("sft.yml", "run_name=x", "posttrain_mode=nope", cwd=tmp_path)
  assert completed.returncode == 1
  assert "Unknown posttrain_mode 'nope'" in _last_line(completed)


def test_pytest_hides_third_party_deprecations_and_keeps_ours(tmp_path):
  """pyproject.toml's filters silence warnings raised for Flax, MaxText and qwix (thousands per suite run); one
  raised for this package's code still shows."""
  (tmp_path / "test_warnings.py").write_text(
      "import warnings\n\n\ndef test_warns():\n"
      + "".join(
          f"  warnings.warn_explicit('deprecated call in {module}', DeprecationWarning, 'x.py', 1, module='{module}')\n"
          for module in ("flax.nnx.statelib", "maxtext.layers.nnx_scan", "qwix._src.model", "maxtext_posttrain.trainer")
      )
  )
  completed = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(paths.REPO / "pyproject.toml")]
      + ["--rootdir", str(tmp_path), str(tmp_path / "test_warnings.py")],
      capture_output=True,
      text=True,
      timeout=120,
      check=False,
  )
  assert completed.returncode == 0, completed.stdout
  assert "1 passed, 1 warning" in completed.stdout, completed.stdout
  assert "deprecated call in maxtext_posttrain.trainer" in completed.stdout


def test_every_module_imports_beside_the_others():
  """The commands' absl flags live in one registry: two modules defining the same flag would fail whichever imports
  second (a test session imports them all), so every module is imported here in one process."""
  import importlib  # pylint: disable=import-outside-toplevel
  import pkgutil  # pylint: disable=import-outside-toplevel

  import maxtext_posttrain  # pylint: disable=import-outside-toplevel

  names = [m.name for m in pkgutil.walk_packages(maxtext_posttrain.__path__, "maxtext_posttrain.")]
  assert {"maxtext_posttrain.demo", "maxtext_posttrain.pii_redact", "maxtext_posttrain.plant_canaries"} <= set(names)
  for name in names:
    importlib.import_module(name)

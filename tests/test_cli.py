"""The entry point as a MaxText user runs it: our yml, or MaxText's own base.yml plus `posttrain_mode`."""

import json
import os
import subprocess
import sys

import pytest

from tests import paths


def _train(*args, cwd):
  env = dict(os.environ, PYTHONPATH=str(paths.REPO))
  return subprocess.run(
      [sys.executable, "-m", "maxtext_posttrain.train", *args],
      cwd=cwd,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
      check=False,
  )


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
  with pytest.raises(ValueError, match=r"Unknown posttrain_mode 'grpoo'\. Registered modes: .*sft"):
    make_config("posttrain_mode=grpoo")


def test_unknown_key_is_named(make_config):
  with pytest.raises(ValueError, match="sft_train_on_completion_onyl"):
    make_config("sft_train_on_completion_onyl=true")


def test_unknown_mode_exits_nonzero_from_the_command_line(tmp_path):
  completed = _train(str(paths.REPO / "configs" / "sft.yml"), "run_name=x", "posttrain_mode=nope", cwd=tmp_path)
  assert completed.returncode != 0
  assert "Unknown posttrain_mode 'nope'" in completed.stderr

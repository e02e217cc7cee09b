"""The benchmark harness runs end to end and writes its JSON row (timings themselves are not asserted)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from benchmarks import decode
from benchmarks import distill_vs_pretrain
from benchmarks import dpo_vs_pretrain
from benchmarks import grpo_vs_pretrain
from benchmarks import harness
from benchmarks import peers
from benchmarks import ppo_vs_pretrain
from benchmarks import rollouts_ahead
from benchmarks import peft_memory
from benchmarks import sft_vs_pretrain
from maxtext.utils import maxtext_utils
from maxtext_posttrain import config as posttrain_config
from tests import paths
from tests import run_utils


def test_sft_vs_pretrain_writes_a_row(tmp_path, tfds_dir, capsys):
  output = tmp_path / "bench.json"
  tiny = ["base_emb_dim=64", "base_mlp_dim=128", "base_num_decoder_layers=1", "max_target_length=128"]
  sft_vs_pretrain.main(["", "--repeats=2", f"--output={output}", f"dataset_path={tfds_dir}", *tiny])
  (row,) = json.loads(output.read_text())
  assert row["objective"] == "sft" and row["model_parameters"] < 1e6
  assert len(row["step_times_s"]["sft"]) == len(row["step_times_s"]["pretrain"]) == 2
  assert row["ratio"] == row["step_time_s"] / row["pretrain_step_time_s"] > 0
  printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith('{"objective"')]
  assert json.loads(printed[-1])["ratio"] == row["ratio"]


def test_decode_benchmark_writes_a_row(tmp_path, tfds_dir):
  output = tmp_path / "decode.json"
  tiny = ["base_emb_dim=64", "base_mlp_dim=128", "base_num_decoder_layers=1", f"dataset_path={tfds_dir}"]
  decode.main(["", *tiny, "--new_tokens=16", "--prompts=2", "--samples=2", "--repeats=1", f"--output={output}"])
  (row,) = json.loads(output.read_text())
  assert row["speedup_vs_no_cache"] > 1.0, row  # even 16 tokens of a 1-layer model beat recomputation


def test_dpo_vs_pretrain_splits_the_step_and_states_the_flops_prediction(tmp_path, tfds_dir):
  output = tmp_path / "dpo.json"
  tiny = ["base_emb_dim=64", "base_mlp_dim=128", "base_num_decoder_layers=1", "max_target_length=128"]
  dpo_vs_pretrain.main(
      ["", "--repeats=2", f"--output={output}", f"dataset_path={tfds_dir}", *tiny, "dpo.max_prompt_length=64"]
  )
  (row,) = json.loads(output.read_text())
  assert row["objective"] == "dpo (dpo)" and row["predicted_ratio"] == 2 + 2 / 3
  assert len(row["step_times_s"]["reference"]) == len(row["step_times_s"]["pretrain"]) == 2
  assert row["step_time_s"] > row["train_time_s"] > 0 and row["reference_time_s"] > 0
  assert row["ratio_vs_predicted"] == row["ratio"] / row["predicted_ratio"]


def test_grpo_vs_pretrain_splits_the_step_into_rollout_reference_and_train(tmp_path, tfds_dir):
  output = tmp_path / "grpo.json"
  tiny = ["base_emb_dim=64", "base_mlp_dim=128", "base_num_decoder_layers=1", "max_target_length=160"]
  grpo_vs_pretrain.main(["", "--repeats=2", f"--output={output}", f"dataset_path={tfds_dir}", *tiny])
  (row,) = json.loads(output.read_text())
  assert row["objective"] == "grpo (G=8, beta=0.04)"
  assert len(row["step_times_s"]["rollout"]) == len(row["step_times_s"]["pretrain"]) == 2
  assert min(row[f"{part}_time_s"] for part in ("rollout", "reward", "reference", "train")) > 0
  paired = [t / p for t, p in zip(row["step_times_s"]["train"], row["step_times_s"]["pretrain"])]
  assert row["train_ratio"] == (paired[0] + paired[1]) / 2  # the median of the rounds' ratios
  assert 0.5 < row["train_flops_ratio"] < 1  # the LM head on the completions only


def test_rollouts_ahead_times_both_ways_on_a_split_of_four_devices(tmp_path, tfds_dir):
  """On 4 fake devices the trainer and the sampler get 2 each, the reference the sampler's 2
  (rl.reference_devices=sampler, dispatched from a step that runs under the trainer's mesh); both ways of stepping
  are timed, and one device is refused in one line."""
  output = tmp_path / "ahead.json"
  tiny = ["base_emb_dim=64", "base_mlp_dim=128", "base_num_decoder_layers=1", "max_target_length=160"]
  tiny += ["rl.grpo_beta=0.04", "rl.reference_devices=sampler"]
  env = dict(os.environ, XLA_FLAGS=run_utils.xla_flags(4), PYTHONPATH=str(paths.REPO))
  command = [sys.executable, "-m", "benchmarks.rollouts_ahead", "--repeats=1", "--block=3", f"--output={output}"]
  completed = subprocess.run(
      [*command, f"dataset_path={tfds_dir}", *tiny], env=env, capture_output=True, text=True, timeout=600, check=False
  )
  assert completed.returncode == 0, completed.stderr[-3000:]
  (row,) = json.loads(output.read_text())
  assert (row["trainer_devices"], row["sampler_devices"]) == (2, 2)
  assert len(row["step_times_s"]["ahead"]) == len(row["step_times_s"]["back_to_back"]) == 2  # a block's first left out
  assert row["ahead_ratio"] == row["ahead_time_s"] / row["back_to_back_time_s"]
  with pytest.raises(SystemExit, match="xla_force_host_platform_device_count=4"):
    rollouts_ahead.main(["", f"dataset_path={tfds_dir}"])


def test_peft_memory_counts_state_bytes_and_abstract_model_configs(tmp_path, tfds_dir):
  """QLoRA trains a small share of the bytes and stores the base in far fewer; the same counts come from the
  abstract state of a MaxText model config (llama2-7b, nothing allocated), where both shares are smaller still."""
  output = tmp_path / "peft.json"
  tiny = ["base_emb_dim=128", "base_mlp_dim=512", "base_num_decoder_layers=1", "max_target_length=64"]
  flags = ["--repeats=1", f"--output={output}", "--variants=full,qlora_nf4_r8", "--models=llama2-7b"]
  peft_memory.main(["", *flags, f"dataset_path={tfds_dir}", *tiny])
  rows = {(r["model"], r["variant"]): r for r in json.loads(output.read_text())}
  full, nf4 = rows["benchmark", "full"], rows["benchmark", "qlora_nf4_r8"]
  assert full["base_weight_bytes"] == full["trainable_bytes"] and full["optimizer_bytes"] > full["trainable_bytes"]
  assert nf4["step_time_s"] > 0 and full["step_time_s"] > 0
  # float32 adapters, 8 * (in + out) per kernel of in * out; embeddings and norms are neither adapted nor quantized
  assert nf4["trainable_plus_optimizer_vs_full"] < 0.2 and nf4["base_weight_vs_bf16"] < 0.5
  llama_full, llama_nf4 = rows["llama2-7b", "full"], rows["llama2-7b", "qlora_nf4_r8"]
  assert 6.7e9 < llama_full["model_parameters"] < 6.8e9 and llama_full["step_time_s"] is None
  assert llama_nf4["trainable_plus_optimizer_vs_full"] < 0.01 and 0.25 < llama_nf4["base_weight_vs_bf16"] < 0.3
  # PPO's critic holds no output projection (vocab x emb_dim) and has a scalar head (emb_dim x 1); under LoRA it trains
  # its adapters and head only, over a frozen bf16 base as large as the full one's
  critic_full, critic_lora = rows["llama2-7b critic", "critic_full"], rows["llama2-7b critic", "critic_lora_r8"]
  assert critic_full["model_parameters"] == llama_full["model_parameters"] - 32000 * 4096 + 4096
  assert critic_lora["trainable_plus_optimizer_vs_full"] < 0.01 and critic_lora["base_weight_vs_bf16"] > 0.99


def test_ppo_vs_pretrain_splits_the_step_and_states_the_flops_prediction(tmp_path, tfds_dir):
  output = tmp_path / "ppo.json"
  tiny = ["base_emb_dim=64", "base_mlp_dim=128", "base_num_decoder_layers=1", "max_target_length=160"]
  ppo_vs_pretrain.main(["", "--repeats=2", f"--output={output}", f"dataset_path={tfds_dir}", *tiny])
  (row,) = json.loads(output.read_text())
  parts = ("rollout", "reward", "critic_forward", "reference", "policy_train", "critic_train")
  assert all(row[f"{part}_time_s"] > 0 for part in parts), row
  assert abs(row["step_time_s"] - sum(row[f"{part}_time_s"] for part in parts)) < 1e-9
  assert 1.0 < row["flops_prediction"] < 2.0 and row["ratio_to_prediction"] > 0
  # One program over both roles, against the loop's two: timed, and XLA's scratch bytes of each program.
  assert row["fused_vs_separate"] == row["fused_train_time_s"] / row["separate_train_time_s"] > 0
  assert 0 < max(row["policy_temp_bytes"], row["critic_temp_bytes"]) <= row["fused_temp_bytes"], row


def test_distill_vs_pretrain_times_dense_and_top_k_steps_against_the_flops_prediction(tmp_path):
  """The teacher is the student with twice its decoder layers, from a checkpoint of its seeded initialisation; the
  prediction is 1 + teacher / (3 x student), by MaxText's training TFLOPs of the two configs built here. The offline
  step, on the same teacher's top-k files, runs no teacher: predicted 1, its data k ids and log-probs a token."""
  output = tmp_path / "distill.json"
  tiny = ["base_emb_dim=64", "base_mlp_dim=128", "base_num_decoder_layers=1", "max_target_length=128"]
  distill_vs_pretrain.main(["", "--repeats=1", "--top_k=8", f"--output={output}", *tiny])
  (row,) = json.loads(output.read_text())
  assert row["objective"] == "distill (forward_kl, teacher 2 layers, student 1)" and row["top_k"] == 8
  assert [len(row["step_times_s"][name]) for name in ("distill", "top_k", "offline", "pretrain")] == [1, 1, 1, 1]
  timed = ("step_time_s", "pretrain_step_time_s", "ratio", "ratio_to_prediction", "top_k_step_time_s", "top_k_ratio")
  timed += ("top_k_vs_dense", "offline_step_time_s", "offline_ratio", "offline_vs_online_top_k")
  assert min(row[key] for key in timed) > 0, row
  assert row["offline_flops_prediction"] == 1.0
  assert row["offline_bytes_per_token"] > 8 * (4 + 4), row  # int32 ids and float32 log-probs, plus log_rest

  def tflops(*keys):
    argv = ["", "distill.yml", *harness.BENCHMARK_MODEL, *tiny, *keys]
    return maxtext_utils.calculate_tflops_training_per_device(posttrain_config.initialize(argv), log=False)[0]

  student, teacher = tflops(), tflops("base_num_decoder_layers=2")
  assert row["flops_prediction"] == 1 + teacher / (3 * student) > 1
  assert row["ratio_to_prediction"] == row["ratio"] / row["flops_prediction"]


def test_peers_without_tunix_exits_with_one_line_naming_make_peers_env(tmp_path):
  """The project's venv has no Tunix: `python -m benchmarks.peers` exits non-zero, before building anything, with
  one line saying how to get it (`make peers-env`, then run it with .venv-peers's Python)."""
  if importlib.util.find_spec("tunix") is not None:
    pytest.skip("Tunix is importable here (.venv-peers); the message is for environments without it.")
  completed = subprocess.run(
      [sys.executable, "-m", "benchmarks.peers", f"--output={tmp_path / 'peers.json'}"],
      cwd=paths.REPO,
      env=dict(os.environ, PYTHONPATH=str(paths.REPO), JAX_PLATFORMS="cpu"),
      capture_output=True,
      text=True,
      timeout=300,
      check=False,
  )
  assert completed.returncode != 0
  message = f"peers: Tunix is not importable (No module named 'tunix'); {peers.MISSING_TUNIX}."
  assert completed.stderr.strip().splitlines()[-1] == message, completed.stderr
  assert "make peers-env" in message and ".venv-peers/bin/python -m benchmarks.peers" in message
  assert not (tmp_path / "peers.json").exists()

"""SFT step time against MaxText's pretraining step on the same model, batch, sequence length and mesh.

Both steps are jitted by MaxText's `train_utils.jit_train_step` with the same state shardings and donation, and
run on the same SFT batch (a packed batch is a valid pretraining batch) in one process, alternating, so machine
noise hits both alike. Prints and writes JSON rows `{objective, step_time_s, pretrain_step_time_s, ratio}`.

  python -m benchmarks.sft_vs_pretrain [configs/sft.yml] [key=value ...] [--repeats=N] [--output=path.json]
"""

import json
import os
import statistics
import sys
import tempfile
import time

import jax
from flax import nnx
from flax.linen import partitioning as nn_partitioning

from maxtext.trainers.pre_train import train as pretrain
from maxtext.utils import sharding
from maxtext.utils import train_utils

from maxtext_posttrain import config as posttrain_config
from maxtext_posttrain import trainer

# About 33M parameters: large enough that the step is compute, not dispatch overhead, on a CPU or an accelerator.
BENCHMARK_MODEL = (
    "base_emb_dim=512",
    "base_num_query_heads=8",
    "base_num_kv_heads=8",
    "head_dim=64",
    "base_mlp_dim=2048",
    "base_num_decoder_layers=8",
    "max_target_length=256",
    "per_device_batch_size=8",
)


def _flag(argv, name, default):
  for arg in argv:
    if arg.startswith(f"--{name}="):
      return arg.split("=", 1)[1]
  return default


def _timed(step_fn, state, batch):
  start = time.perf_counter()
  state, metrics = step_fn(state, batch)
  jax.block_until_ready((state, metrics))
  return state, time.perf_counter() - start


def main(argv):
  repeats = int(_flag(argv, "repeats", "10"))
  output = _flag(argv, "output", "benchmark_sft_vs_pretrain.json")
  args = [a for a in argv[1:] if not a.startswith("--")]
  config_file = args.pop(0) if args and args[0].endswith(".yml") else "configs/sft.yml"
  workdir = tempfile.mkdtemp(prefix="posttrain_bench_")
  config = posttrain_config.initialize(
      ["", config_file, *BENCHMARK_MODEL, "run_name=bench", f"base_output_directory={workdir}"]
      + ["enable_checkpointing=false", "eval_interval=0", "steps=1000", *args]
  )
  loop = trainer.setup(config)
  params_shardings, _ = sharding.maybe_update_params_sharding_with_opt(config, loop.state_mesh_shardings)
  p_pretrain_step = train_utils.jit_train_step(
      config,
      loop.graphdef,
      loop.state,
      loop.state_mesh_shardings,
      sharding.get_input_data_sharding(config, loop.mesh),
      pretrain.train_step,
      params_shardings,
      mesh=loop.mesh,
  )
  batch = loop.train_batches.load_next_batch()
  state = loop.state
  times = {"sft": [], "pretrain": []}
  with jax.set_mesh(loop.mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
    for fn in (loop.p_train_step, p_pretrain_step):  # compile both, and one warm step each
      for _ in range(2):
        state, _ = _timed(fn, state, batch)
    for _ in range(repeats):
      state, seconds = _timed(p_pretrain_step, state, batch)
      times["pretrain"].append(seconds)
      state, seconds = _timed(loop.p_train_step, state, batch)
      times["sft"].append(seconds)
  num_params = sum(x.size for x in jax.tree.leaves(state.model.filter(nnx.Param)))
  row = {
      "objective": "sft",
      "step_time_s": statistics.median(times["sft"]),
      "pretrain_step_time_s": statistics.median(times["pretrain"]),
  }
  row["ratio"] = row["step_time_s"] / row["pretrain_step_time_s"]
  row |= {
      "model_parameters": int(num_params),
      "global_batch": config.global_batch_size_to_train_on,
      "max_target_length": config.max_target_length,
      "mesh": dict(loop.mesh.shape),
      "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
      "repeats": repeats,
      "step_times_s": times,
  }
  with open(output, "w", encoding="utf-8") as f:
    json.dump([row], f, indent=2)
  print(json.dumps({k: row[k] for k in ("objective", "step_time_s", "pretrain_step_time_s", "ratio")}))
  print(f"model parameters: {num_params / 1e6:.1f}M, wrote {os.path.abspath(output)}")


if __name__ == "__main__":
  main(sys.argv)

"""What the benchmarks share: the benchmark model and their command line.

  python -m benchmarks.<name> [sft.yml] [key=value ...] [--flag=value ...]

A leading yml replaces the benchmark's config (sft.yml unless it says otherwise); `key=value` arguments override the config after BENCHMARK_MODEL; `--flags`
are the benchmark's own options.
"""

import atexit
import dataclasses
import json
import os
import shutil
import tempfile

import jax
from flax import nnx

from maxtext.trainers.pre_train import train as pretrain
from maxtext.utils import sharding
from maxtext.utils import train_utils

from maxtext_posttrain import config as posttrain_config

# About 34M parameters: large enough that the step is compute, not dispatch overhead, on a CPU or an accelerator.
# Its embedding is as wide as that of the narrowest released-model config MaxText ships (qwen3-0.6b, 1024):
# per-kernel figures such as a LoRA adapter's share of its kernel, rank * (in + out) / (in * out), depend on width,
# and a narrower toy overstates them.
BENCHMARK_MODEL = (
    "base_emb_dim=1024",
    "base_num_query_heads=16",
    "base_num_kv_heads=16",
    "head_dim=64",
    "base_mlp_dim=4096",
    "base_num_decoder_layers=2",
    "max_target_length=256",
    "per_device_batch_size=8",
)


@dataclasses.dataclass(frozen=True)
class Args:
  config_file: str
  overrides: tuple[str, ...]
  flags: dict[str, str]

  def flag(self, name: str, default: str) -> str:
    return self.flags.get(name, default)

  def config(self, run_name: str, *keys: str):
    """The benchmark model from the config file, writing nowhere that outlives the process, plus `keys`."""
    return _initialize(self.config_file, run_name, *BENCHMARK_MODEL, *keys, *self.overrides)

  def model_config(self, run_name: str, model_name: str, *keys: str):
    """MaxText's `model_name` config over the config file, plus `keys`; the command line's `key=value` overrides
    shape the benchmark model and are not applied."""
    return _initialize(self.config_file, run_name, f"model_name={model_name}", *keys)


def _initialize(config_file: str, run_name: str, *keys: str):
  workdir = tempfile.mkdtemp(prefix=f"posttrain_bench_{run_name}_")
  atexit.register(shutil.rmtree, workdir, ignore_errors=True)
  return posttrain_config.initialize(
      ["", config_file, f"run_name={run_name}", f"base_output_directory={workdir}"]
      + ["enable_checkpointing=false", "eval_interval=0", "steps=1000", *keys]
  )


def parse(argv, default_config: str = "sft.yml") -> Args:
  flags = dict(a[2:].split("=", 1) for a in argv[1:] if a.startswith("--"))
  args = [a for a in argv[1:] if not a.startswith("--")]
  config_file = args.pop(0) if args and args[0].endswith(".yml") else default_config
  return Args(config_file, tuple(args), flags)


def jit_pretraining_step(loop, config=None):
  """MaxText's own pretraining `train_step`, jitted by MaxText with the loop's state shardings and donation; `config`
  (the loop's by default) sets its batch size, since MaxText's step trains on the first `micro_batch_size_to_train_on`
  rows of a batch."""
  config = config or loop.config
  params_shardings, _ = sharding.maybe_update_params_sharding_with_opt(config, loop.primary.state_mesh_shardings)
  return train_utils.jit_train_step(
      config,
      loop.primary.graphdef,
      loop.primary.state,
      loop.primary.state_mesh_shardings,
      sharding.get_input_data_sharding(config, loop.mesh),
      pretrain.train_step,
      params_shardings,
      mesh=loop.mesh,
  )


def write_row(row: dict, loop, repeats: int, times: dict, output: str, printed: tuple[str, ...]) -> None:
  """Adds the run's context (model size, shapes, mesh, devices, every step time) to `row`, writes it as a one-row
  JSON list to `output` and prints the `printed` keys."""
  config = loop.config
  num_params = sum(x.size for x in jax.tree.leaves(loop.primary.state.model.filter(nnx.Param)))
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
  print(json.dumps({k: row[k] for k in printed}))
  print(f"model parameters: {num_params / 1e6:.1f}M, wrote {os.path.abspath(output)}")

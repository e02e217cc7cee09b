"""What the benchmarks share: the benchmark model and their command line.

  python -m benchmarks.<name> [configs/sft.yml] [key=value ...] [--flag=value ...]

A leading yml replaces configs/sft.yml; `key=value` arguments override the config after BENCHMARK_MODEL; `--flags`
are the benchmark's own options.
"""

import dataclasses
import tempfile

from maxtext_posttrain import config as posttrain_config

# About 34M parameters: large enough that the step is compute, not dispatch overhead, on a CPU or an accelerator.
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


@dataclasses.dataclass(frozen=True)
class Args:
  config_file: str
  overrides: tuple[str, ...]
  flags: dict[str, str]

  def flag(self, name: str, default: str) -> str:
    return self.flags.get(name, default)

  def config(self, run_name: str, *keys: str):
    """The benchmark model from the config file, writing nowhere that outlives the process, plus `keys`."""
    workdir = tempfile.mkdtemp(prefix=f"posttrain_bench_{run_name}_")
    return posttrain_config.initialize(
        ["", self.config_file, *BENCHMARK_MODEL, f"run_name={run_name}", f"base_output_directory={workdir}"]
        + ["enable_checkpointing=false", "eval_interval=0", "steps=1000", *keys, *self.overrides]
    )


def parse(argv) -> Args:
  flags = dict(a[2:].split("=", 1) for a in argv[1:] if a.startswith("--"))
  args = [a for a in argv[1:] if not a.startswith("--")]
  config_file = args.pop(0) if args and args[0].endswith(".yml") else "configs/sft.yml"
  return Args(config_file, tuple(args), flags)

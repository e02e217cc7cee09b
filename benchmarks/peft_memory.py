"""Memory and step time of full fine-tuning vs LoRA vs QLoRA on the benchmark model of `sft_vs_pretrain`.

Per variant, from the state the loop actually builds (`trainer.setup`): bytes of the trained parameters plus their
optimizer state, bytes of the frozen base weights, and the median time of the jitted train step on one batch, with
its ratio to full fine-tuning measured in the same process. Bytes count the stored bits of each dtype (nf4 codes are
4 bits, as on TPU; a CPU buffer may hold them unpacked). Weights are bf16 (`weight_dtype=bfloat16`), so the base
rows compare bf16 vs nf4 vs int8. Prints and writes JSON rows.

  python -m benchmarks.peft_memory [configs/sft.yml] [key=value ...] [--repeats=N] [--output=path.json]
"""

import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import partitioning as nn_partitioning

from benchmarks import harness
from maxtext_posttrain import trainer
from maxtext_posttrain.peft import lora

LORA = ("lora.enable_lora=true", "lora.lora_rank=8", "lora.lora_alpha=16")
VARIANTS = {
    "full": (),
    "lora_r8": LORA,
    # Attention projections only (the original LoRA recipe); the row above targets MaxText's default q/k/v/out + MLP.
    "lora_r8_attention": (*LORA, "lora.lora_module_path=decoder/layers/self_attention/(query|key|value|out)"),
    "qlora_nf4_r8": (*LORA, "lora.lora_weight_qtype=nf4"),
    "qlora_int8_r8": (*LORA, "lora.lora_weight_qtype=int8"),
}


def _bytes(tree) -> int:
  def leaf_bytes(x):
    dtype = jnp.dtype(x.dtype)
    bits = jnp.iinfo(dtype).bits if jnp.issubdtype(dtype, jnp.integer) else jnp.finfo(dtype).bits
    return x.size * bits // 8

  return sum(leaf_bytes(x) for x in jax.tree.leaves(tree) if hasattr(x, "dtype") and x.size and x.dtype != bool)


def measure(config, repeats: int) -> dict:
  loop = trainer.setup(config)
  model = loop.policy()
  trained = nnx.state(model, lora.trainable(config))
  frozen = nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))) if lora.enabled(config) else {}
  batch = loop.train_batches.load_next_batch()
  state, times = loop.state, []
  with jax.set_mesh(loop.mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
    state, metrics = loop.p_train_step(state, batch)  # compile
    jax.block_until_ready((state, metrics))
    for _ in range(repeats):
      start = time.perf_counter()
      state, metrics = loop.p_train_step(state, batch)
      jax.block_until_ready((state, metrics))
      times.append(time.perf_counter() - start)
  return {
      "trainable_bytes": _bytes(trained),
      "optimizer_bytes": _bytes(state.optimizer.opt_state),
      "base_weight_bytes": _bytes(frozen if lora.enabled(config) else trained),
      "step_time_s": statistics.median(times),
  }


def main(argv):
  args = harness.parse(argv)
  repeats = int(args.flag("repeats", "5"))
  output = args.flag("output", "benchmark_peft_memory.json")
  rows = []
  for name, keys in VARIANTS.items():
    config = args.config(name, "weight_dtype=bfloat16", *keys)
    rows.append({"variant": name, **measure(config, repeats)})
  full = rows[0]
  full_trained = full["trainable_bytes"] + full["optimizer_bytes"]
  for row in rows:
    row["trainable_plus_optimizer_vs_full"] = (row["trainable_bytes"] + row["optimizer_bytes"]) / full_trained
    row["base_weight_vs_bf16"] = row["base_weight_bytes"] / full["base_weight_bytes"]
    row["step_time_vs_full"] = row["step_time_s"] / full["step_time_s"]
    print(
        f"{row['variant']:>14}: trainable+optimizer {(row['trainable_bytes'] + row['optimizer_bytes']) / 2**20:8.2f} MiB "
        f"({row['trainable_plus_optimizer_vs_full']:.2%} of full), base weights {row['base_weight_bytes'] / 2**20:7.2f} "
        f"MiB ({row['base_weight_vs_bf16']:.2%} of bf16), step {row['step_time_s'] * 1000:8.1f} ms "
        f"({row['step_time_vs_full']:.2f}x full)"
    )
  with open(output, "w", encoding="utf-8") as f:
    json.dump(rows, f, indent=2)
  print(f"wrote {output}")
  return rows


if __name__ == "__main__":
  main(sys.argv)

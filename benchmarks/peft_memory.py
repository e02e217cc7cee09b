"""Memory and step time of full fine-tuning vs LoRA vs QLoRA on the benchmark model of `sft_vs_pretrain`, and the
memory of the same variants on MaxText's own model configs.

Per variant, from the state the loop builds (`trained_model.state_initializer`): bytes of the trained parameters plus their
optimizer state, bytes of the frozen base weights, and, on the benchmark model, the median time of the jitted train
step on one batch, with its ratio to full fine-tuning measured in the same process. `--models=llama2-7b,...` adds
the byte rows of MaxText model configs (`model_name=...`; the `key=value` overrides shape only the benchmark model)
from the abstract state (`nnx.eval_shape`), which allocates nothing, so a 7B model's figures come out on a laptop.
LoRA's share of a kernel is rank * (in + out) / (in * out), so it shrinks as models widen. Bytes count the stored
bits of each dtype (nf4 codes are 4 bits, as on TPU; a CPU buffer may hold them unpacked). Weights are bf16
(`weight_dtype=bfloat16`), so the base rows compare bf16 vs nf4 vs int8. Rows of model `<model> critic` give PPO's
critic (the decoder with a scalar head) trained in full and under LoRA (`lora_roles=[critic]`: adapters and the
head train, the base stays frozen), from the abstract state. Prints and writes JSON rows.

  python -m benchmarks.peft_memory [sft.yml] [key=value ...] [--repeats=N] [--models=llama2-7b,...]
      [--variants=full,lora_r8,...] [--output=path.json]
"""

import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import partitioning as nn_partitioning

from maxtext.utils import maxtext_utils

from benchmarks import harness
from maxtext_posttrain import roles
from maxtext_posttrain import trained_model
from maxtext_posttrain import trainer
from maxtext_posttrain.peft import lora

LORA = ("lora.enable_lora=true", "lora.lora_rank=8", "lora.lora_alpha=16")
VARIANTS = {
    "full": (),
    "lora_r8": LORA,
    # Attention projections only (the original LoRA recipe); the row above targets MaxText's default q/k/v/out + MLP.
    "lora_r8_attention": (*LORA, "lora.lora_module_path=decoder/layers/self_attention[^/]*/(query|key|value|out)"),
    "qlora_nf4_r8": (*LORA, "lora.lora_weight_qtype=nf4"),
    "qlora_int8_r8": (*LORA, "lora.lora_weight_qtype=int8"),
}


def _bytes(tree) -> int:
  def leaf_bytes(x):
    dtype = jnp.dtype(x.dtype)
    bits = jnp.iinfo(dtype).bits if jnp.issubdtype(dtype, jnp.integer) else jnp.finfo(dtype).bits
    return x.size * bits // 8

  return sum(leaf_bytes(x) for x in jax.tree.leaves(tree) if hasattr(x, "dtype") and x.size and x.dtype != bool)


# PPO's critic (MaxText's decoder with a scalar head) trained in full or under LoRA (adapters plus the head).
CRITIC = roles.RoleSpec("critic", trained=True, head="scalar")
CRITIC_VARIANTS = {"critic_full": (), "critic_lora_r8": (*LORA, "lora_roles=[critic]")}


def state_bytes(state: nnx.State, config, spec: roles.RoleSpec = roles.policy()) -> dict:
  """Bytes of a train state (concrete, or abstract from `nnx.eval_shape`): trained weights, their optimizer state,
  and the frozen base (the trained weights themselves under full fine-tuning)."""
  trained = state.model.filter(trained_model.trainable_filter(config, spec))
  frozen = state.model.filter(nnx.All(nnx.Param, nnx.Not(trained_model.trainable_filter(config, spec))))
  frozen = frozen if lora.enabled(config, spec.name) else trained
  return {
      "trainable_bytes": _bytes(trained),
      "optimizer_bytes": _bytes(state.optimizer.opt_state),
      "base_weight_bytes": _bytes(frozen),
  }


def measure(config, repeats: int) -> dict:
  """Bytes and the median step time of the loop's state and jitted train step on one batch."""
  loop = trainer.setup(config)
  batch = loop.train_batches.load_next_batch()
  state, times = loop.primary.state, []
  with jax.set_mesh(loop.mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
    row = state_bytes(state, config)
    state, metrics = loop.primary.p_train_step(state, batch, {})  # compile
    jax.block_until_ready((state, metrics))
    for _ in range(repeats):
      start = time.perf_counter()
      state, metrics = loop.primary.p_train_step(state, batch, {})
      jax.block_until_ready((state, metrics))
      times.append(time.perf_counter() - start)
  return row | {"step_time_s": statistics.median(times)}


def measure_abstract(config, spec: roles.RoleSpec = roles.policy()) -> dict:
  """Bytes of the state the loop would build for `config`'s role `spec`, from its shapes alone."""
  init_state_fn, _ = trained_model.state_initializer(config, maxtext_utils.get_mesh_from_config(config), spec)
  with nn_partitioning.axis_rules(config.logical_axis_rules):
    return state_bytes(nnx.state(nnx.eval_shape(init_state_fn)), config, spec)


def _add_ratios(rows: list[dict]) -> None:
  """Each row against the same model's full fine-tuning row (the first of its model), whose trained weights are
  all of the model's parameters in bf16."""
  full = {}
  for row in rows:
    full.setdefault(row["model"], row)
    base = full[row["model"]]
    row["model_parameters"] = base["trainable_bytes"] // 2
    row["trainable_plus_optimizer_vs_full"] = (row["trainable_bytes"] + row["optimizer_bytes"]) / (
        base["trainable_bytes"] + base["optimizer_bytes"]
    )
    row["base_weight_vs_bf16"] = row["base_weight_bytes"] / base["base_weight_bytes"]
    if row["step_time_s"] is not None:
      row["step_time_vs_full"] = row["step_time_s"] / base["step_time_s"]


def _print(row: dict) -> None:
  step = (
      ""
      if row["step_time_s"] is None
      else (f", step {row['step_time_s'] * 1000:8.1f} ms ({row['step_time_vs_full']:.2f}x full)")
  )
  print(
      f"{row['model']:>14} {row['variant']:>17}: trainable+optimizer "
      f"{(row['trainable_bytes'] + row['optimizer_bytes']) / 2**20:10.2f} MiB "
      f"({row['trainable_plus_optimizer_vs_full']:.2%} of full), base weights {row['base_weight_bytes'] / 2**20:9.2f} "
      f"MiB ({row['base_weight_vs_bf16']:.2%} of bf16){step}"
  )


def main(argv):
  args = harness.parse(argv)
  repeats = int(args.flag("repeats", "5"))
  output = args.flag("output", "benchmark_peft_memory.json")
  names = args.flag("variants", ",".join(VARIANTS)).split(",")
  if names[0] != "full" or not set(names) <= set(VARIANTS):
    raise ValueError(f"--variants={','.join(names)}: names from {list(VARIANTS)}, starting with full (the baseline).")
  variants = {name: VARIANTS[name] for name in names}
  rows = []
  for name, keys in variants.items():
    config = args.config(name, "weight_dtype=bfloat16", *keys)
    rows.append({"model": "benchmark", "variant": name, **measure(config, repeats)})
  models = list(filter(None, args.flag("models", "").split(",")))
  for model in models:
    for name, keys in variants.items():
      config = args.model_config(name, model, "weight_dtype=bfloat16", *keys)
      rows.append({"model": model, "variant": name, **measure_abstract(config), "step_time_s": None})
  for model in ["benchmark", *models]:  # PPO's critic, full and under LoRA, from the abstract state
    for name, keys in CRITIC_VARIANTS.items():
      if model == "benchmark":
        config = args.config(name, "weight_dtype=bfloat16", *keys)
      else:
        config = args.model_config(name, model, "weight_dtype=bfloat16", *keys)
      row = {"model": f"{model} critic", "variant": name, **measure_abstract(config, CRITIC), "step_time_s": None}
      rows.append(row)
  _add_ratios(rows)
  for row in rows:
    _print(row)
  with open(output, "w", encoding="utf-8") as f:
    json.dump(rows, f, indent=2)
  print(f"wrote {output}")
  return rows


if __name__ == "__main__":
  main(sys.argv)

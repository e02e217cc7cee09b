"""LoRA and QLoRA under MaxText's TPU precision: activations in bfloat16, weights (and so the adapters) in float32
or bfloat16, on every objective. qwix's adapters used to promote a bfloat16 layer's output to float32, which failed
the scanned decoder's trace at setup; here each run trains, moves the adapters and leaves the base bit-identical."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtext_posttrain import trainer
from maxtext_posttrain.peft import lora
from tests import run_utils

LORA = ("lora.enable_lora=true", "lora.lora_rank=4", "lora.lora_alpha=8", "learning_rate=1e-2")
SHORT = ("steps=2", "eval_interval=0", "enable_checkpointing=false", "per_device_batch_size=2")
# Each objective's config and the shortest rows it takes. SFT accumulates two microbatches, which differentiates the
# adapters on a path of its own (trainer._accumulated_adapter_grads). GRPO's reward varies even under random weights,
# so its advantages, and hence its adapter gradients, are not zero.
OBJECTIVES = {
    "sft": ("sft_lora.yml", ("max_target_length=64", "gradient_accumulation_steps=2")),
    "dpo": ("dpo.yml", (*LORA, "max_target_length=96")),
    "grpo": (
        "grpo.yml",
        (*LORA, "rl.num_generations=4", "max_target_length=80")
        + ('rl.rewards=["tests.rewards_for_tests:characters"]', "rl.reward_weights=[1.0]"),
    ),
}


def _frozen(model) -> dict:
  return jax.device_get(nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))).to_pure_dict())


def _adapters(model) -> dict:
  return jax.device_get(nnx.state(model, nnx.LoRAParam).to_pure_dict())


@pytest.mark.parametrize("weight_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("qtype", ["", "nf4"], ids=["lora", "qlora"])
@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_adapters_train_under_bfloat16_compute(make_config, tmp_path, objective, qtype, weight_dtype):
  """Finite losses, every adapter moved and kept in `weight_dtype` (the optimizer updates them there), the base
  bit-identical, and the merged weights that the sampler and the export read in `weight_dtype` too."""
  config_file, overrides = OBJECTIVES[objective]
  metrics = tmp_path / "metrics.jsonl"
  config = make_config(
      *overrides, *SHORT, "dtype=bfloat16", f"weight_dtype={weight_dtype}", f"lora.lora_weight_qtype={qtype}",
      f"metrics_file={metrics}", config_file=config_file,
  )  # fmt: skip
  loop = trainer.setup(config)
  frozen, adapters = _frozen(loop.policy()), _adapters(loop.policy())
  trainer.train(loop)
  losses = run_utils.losses(metrics)
  assert sorted(losses) == [0, 1] and np.all(np.isfinite(list(losses.values()))), losses
  jax.tree.map(np.testing.assert_array_equal, _frozen(loop.policy()), frozen)
  trained = _adapters(loop.policy())
  assert {leaf.dtype for leaf in jax.tree.leaves(trained)} == {jnp.dtype(weight_dtype)}
  moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), trained, adapters)
  assert jax.tree.leaves(moved) and all(jax.tree.leaves(moved)), moved
  merged = jax.tree.leaves(lora.merged_params(loop.policy(), config))
  assert {leaf.dtype for leaf in merged} == {jnp.dtype(weight_dtype)}

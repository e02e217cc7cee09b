"""Load, short form: after warm-up the sampler and a GRPO loop compile nothing and keep host memory flat.

`benchmarks/load.py` runs the same code for thousands of rollouts. Here, on tests/test_grpo.py's tiny rollouts (2
prompts x 4 samples, 16 new tokens): 200 sampler calls on new prompts of varying lengths and a new key each, warmed
up by the first; and a 51-step GRPO loop that evaluates and saves a checkpoint every 10 steps, warmed up by its first
11 (its first periodic evaluation and save after step 0), so the 40 steps after them repeat every kind of step it ran.
"""

import json

from benchmarks import load

TINY = ("per_device_batch_size=2", "rl.num_generations=4", "max_target_length=80")
# Synchronous saves: the same checkpointing without an asynchronous save's background writes, which move RSS by up to
# 35 MiB for tens of steps (the long form runs them).
EVERY_10_STEPS = ("eval_interval=10", "checkpoint_period=10", "async_checkpointing=false")
SMALL_EVAL = ("eval_generation_examples=4", "eval_samples_per_prompt=2", "eval_pass_at_k=[1,2]")
# Bounds on the rise of benchmarks/load.py's RSS line after warm-up, per part. Measured on the 2-core machine: 0 to 5
# MiB for the sampler, 0 to 29 MiB for the loop, whose checkpoint saves raise RSS in steps of up to 18 MiB while
# orbax and tensorstore settle (about 30 MiB over the first 75 saves, then flat). Kept for every unit of work, 24 MiB
# is 0.12 MiB a call of the sampler's 199 and 64 MiB is 1.6 MiB a step of the loop's 40: a leaked decode KV cache
# (1.25 MiB), copy of the policy's float32 weights (2.5 MiB) or executable per call fails the first, a leaked copy of
# the weights or of the train state (7.5 MiB) per step the second. A leak of the rollouts themselves (kilobytes a
# step here) stays under both and shows in the long form's slope over thousands of rollouts.
RSS_GROWTH_BOUND_MIB = {"sampler": 24, "grpo": 64}


def test_sampler_and_grpo_loop_compile_nothing_after_warm_up_and_keep_host_memory_flat(tmp_path, tfds_dir):
  output = tmp_path / "load.json"
  flags = ["--sampler_calls=200", "--grpo_steps=51", f"--output={output}", f"--plot={tmp_path / 'load.png'}"]
  load.main(["", *TINY, *EVERY_10_STEPS, *SMALL_EVAL, f"dataset_path={tfds_dir}", *flags])
  sampler, grpo = json.loads(output.read_text())
  assert (sampler["rollouts"], grpo["rollouts"], grpo["warmup_steps"]) == (200 * 8, 51 * 8, 11)
  for row in (sampler, grpo):
    # The decode program (and the train step) compiled during warm-up: the count hears compilations.
    assert row["compiles_warmup"] > 0, row["part"]
    assert row["compiles_after_warmup"] == 0, (row["part"], row["compiled_after_warmup"])
    assert row["rss_growth_mib"] < RSS_GROWTH_BOUND_MIB[row["part"]], (row["part"], row["rss_window_medians"])

"""RL sampling throughput: the KV-cache sampler against recomputing the full forward every step, on one model.

Both sample B prompts x N samples (weighted, T = 1, no EOS so every row decodes all new tokens) from the same
params in one process. The sampler is timed end to end (`Sampler.sample`: prefill once per prompt, cache broadcast
to the samples, the on-device token loop) and with one new token (prefill plus the first draw), which splits its
time into prefill and per-token decode. The baseline is the obvious program without a cache: one jitted
`fori_loop` that runs the train-mode forward over the whole [rows, prompt + new tokens] buffer at every step and
draws the next token from the last real position. Its steps all cost the same (static shapes), so it is timed over
`--baseline_steps` steps and scaled to the full count when that is fewer (the JSON says which). MaxText's own
OfflineEngine is tried on the same config; where it cannot run, the row says why.

  python -m benchmarks.decode [sft.yml] [key=value ...] [--prompts=8] [--samples=4] [--new_tokens=128]
      [--repeats=3] [--baseline_steps=128] [--output=path.json]
"""

import importlib.util
import json
import os
import statistics
import sys
import time

from flax import nnx
from flax.linen import partitioning as nn_partitioning
import jax
import jax.numpy as jnp
import numpy as np

from maxtext.utils import maxtext_utils
from maxtext.utils import maxtext_utils_nnx
from maxtext.utils import model_creation_utils

from benchmarks import harness
from maxtext_posttrain import rollout

NO_EOS = -1


def _median_time(fn, repeats):
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times), times


def _no_cache_program(graphdef, rest, steps):
  """Jitted: `steps` tokens per row, each from a train-mode forward over the whole buffer (no KV cache)."""

  @jax.jit
  def run(params, tokens, lengths, rng):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    rows = jnp.arange(tokens.shape[0])

    def body(step, tokens):
      model = nnx.merge(graphdef, params, rest, copy=True)
      segment_ids = (positions < (lengths + step)[:, None]).astype(jnp.int32)
      logits = model(tokens, positions, decoder_segment_ids=segment_ids, enable_dropout=False)
      last = logits[rows, lengths + step - 1].astype(jnp.float32)
      keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.fold_in(rng, step), rows)
      token = jax.vmap(jax.random.categorical)(keys, last).astype(jnp.int32)
      return tokens.at[rows, lengths + step].set(token)

    return jax.lax.fori_loop(0, steps, body, tokens)

  return run


def _offline_engine(config, args, num_prompts, num_samples, new_tokens, prompts):
  """MaxText's OfflineEngine on the same model size and requests, or why it cannot run here.

  Without JetStream, MaxText 0.2.5 swaps in stubs for its types: prefill's stub `ResultTokens` is not a JAX type, so
  the engine's jitted prefill fails (and registering the stub as a pytree only moves the failure to the
  detokenization thread, which can leave the process hanging), so it is not attempted then.
  """
  if importlib.util.find_spec("jetstream") is None:
    return {"ran": False, "error": "JetStream is not installed; MaxEngine/OfflineEngine need it (see docstring)."}
  try:
    from maxtext.inference import offline_engine  # pylint: disable=import-outside-toplevel

    engine_config = args.config(
        "offline_engine", "return_log_prob=true", f"per_device_batch_size={num_prompts * num_samples}"
    )
    engine = offline_engine.OfflineEngine(
        engine_config, params=None, eos_ids=[NO_EOS], prefill_lengths=[config.max_prefill_predict_length]
    )
    data = [
        offline_engine.InputData(id=str(i), tokens=np.asarray(p, np.int32), true_length=len(p))
        for i, p in enumerate(prompts)
        for _ in range(num_samples)
    ]
    engine.batch_inference(data)  # compile
    seconds, _ = _median_time(lambda: engine.batch_inference(data), 1)
    return {"ran": True, "seconds": seconds, "tokens_per_s": num_prompts * num_samples * new_tokens / seconds}
  except Exception as e:  # pylint: disable=broad-exception-caught
    return {"ran": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}


def main(argv):
  args = harness.parse(argv)
  num_prompts = int(args.flag("prompts", "8"))
  num_samples = int(args.flag("samples", "4"))
  new_tokens = int(args.flag("new_tokens", "128"))
  repeats = int(args.flag("repeats", "3"))
  baseline_steps = min(new_tokens, int(args.flag("baseline_steps", str(new_tokens))))
  output = args.flag("output", "benchmark_decode.json")
  try_offline_engine = args.flag("offline_engine", "true") == "true"
  config = args.config("decode")
  mesh = maxtext_utils.get_mesh_from_config(config)
  create_model, abstract_model = model_creation_utils.create_nnx_abstract_model(config, mesh)
  model = maxtext_utils_nnx.create_nnx_sharded_model(abstract_model, create_model, mesh)
  params = nnx.state(model, nnx.Param)
  num_params = sum(x.size for x in jax.tree.leaves(params))

  # Ragged prompts between half and all of the prefill length (one prompt bucket).
  prefill = config.max_prefill_predict_length
  rng = np.random.default_rng(0)
  prompts = [
      rng.integers(3, config.vocab_size, size=int(n)).tolist()
      for n in rng.integers(prefill // 2, prefill + 1, num_prompts)
  ]
  prompts[0] = prompts[0] + [3] * (prefill - len(prompts[0]))
  sampler = rollout.Sampler(config, mesh)
  sampling = rollout.SamplingParams("weighted", 1.0)

  def sample(max_new):
    out = sampler.sample(params, prompts, max_new, NO_EOS, jax.random.key(1), sampling, num_samples=num_samples)
    assert max_new == 1 or (out.lengths == max_new).all()
    return out.tokens

  sample(new_tokens), sample(1)  # compile
  total_s, total_times = _median_time(lambda: sample(new_tokens), repeats)
  prefill_s, prefill_times = _median_time(lambda: sample(1), repeats)

  rows = num_prompts * num_samples
  graphdef, _, rest = nnx.split(model, nnx.Param, ...)
  no_cache = _no_cache_program(graphdef, rest, baseline_steps)
  buffer = np.zeros((rows, prefill + new_tokens), np.int32)
  for i, prompt in enumerate(p for p in prompts for _ in range(num_samples)):
    buffer[i, : len(prompt)] = prompt
  lengths = np.repeat([len(p) for p in prompts], num_samples).astype(np.int32)
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
    run_no_cache = lambda: no_cache(params, buffer, lengths, jax.random.key(1))
    run_no_cache()  # compile
    measured_s, no_cache_times = _median_time(run_no_cache, 1)
  no_cache_s = measured_s * new_tokens / baseline_steps

  generated = rows * new_tokens
  row = {
      "benchmark": "decode",
      "tokens_per_s": generated / total_s,
      "no_cache_tokens_per_s": generated / no_cache_s,
      "speedup_vs_no_cache": no_cache_s / total_s,
      "prefill_s": prefill_s,
      "decode_per_token_s": (total_s - prefill_s) / (new_tokens - 1),
      "total_s": total_s,
      "prompts": num_prompts,
      "samples_per_prompt": num_samples,
      "new_tokens": new_tokens,
      "prompt_bucket": prefill,
      "model_parameters": int(num_params),
      "no_cache_steps_timed": baseline_steps,
      "no_cache_s": no_cache_s,
      "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
      "repeats": repeats,
      "times_s": {"sample": total_times, "prefill": prefill_times, "no_cache": no_cache_times},
  }
  if try_offline_engine:
    row["offline_engine"] = _offline_engine(config, args, num_prompts, num_samples, new_tokens, prompts)
  with open(output, "w", encoding="utf-8") as f:
    json.dump([row], f, indent=2)
  keys = ("tokens_per_s", "no_cache_tokens_per_s", "speedup_vs_no_cache", "prefill_s", "decode_per_token_s")
  print(json.dumps({k: row[k] for k in keys} | {"offline_engine": row.get("offline_engine")}))
  print(f"model parameters: {num_params / 1e6:.1f}M, wrote {os.path.abspath(output)}")


if __name__ == "__main__":
  main(sys.argv)

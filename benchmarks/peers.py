"""Our GRPO step and sampler against Tunix 0.1.7's, on the same model dims, batch, token counts, optimizer and beta.

The other benchmarks measure a step against MaxText's pretraining step on one model; this one asks how our RL
machinery compares with a peer library's. Both sides run in one process, alternately, on the same CPU devices:

- GRPO step: ours is the project's own path (`trainer.setup`, the GRPO objective's `before_step`: MaxText-decoding
  rollout, rewards, group advantages, reference forward; then the jitted train step), timed as
  `benchmarks.grpo_vs_pretrain` times it. Tunix's is `GRPOLearner` over an `RLCluster` with `rollout_engine='vanilla'`
  and one mesh for actor, reference and rollout unless told otherwise (Layouts, below), one
  `learner.train([batch])` call per step; its rollout, reference log-probs, rewards and actor update are timed by
  wrapping `RLCluster.generate`, `RLCluster.get_ref_per_token_logps` (waited for), `GRPOLearner._compute_rewards` and
  `RLCluster.update_actor`. A step is timed from its start to the end of the optimizer update on both sides (and of
  Tunix's weight copy to its rollout model, when it has one; per-step logging after it is left out on both).
- Log-probs pass: the policy's per-token log-probs of the completions on the last GRPO step's rows, forward and
  backward alone (no loss terms, optimizer or host work), each side through its own function for it: ours the
  objective's `policy_window` (what our loss reads), Tunix's `get_per_token_logps` (what its GRPO loss reads), jitted
  under `jax.value_and_grad` over the weights and timed right after each side's GRPO step, on our step's sequences
  (the same token ids on both sides). It is the model's share of a train step, so the table shows how much of each
  side's train part is the model and how much the step around it (loss, clipping, optimizer, metrics).
- Sampler: B prompts x N samples x T new tokens (weighted, temperature 1, log-probs returned), ours
  `rollout.Sampler.sample`, Tunix's `tunix.generate.sampler.Sampler`, each timed end to end with T tokens and with
  one, which splits it into prefill and per-token decode (as `benchmarks.decode` does).

Made equal: the model (Tunix's own Llama3 built at our config's dims, heads, vocabulary, norm epsilon and untied
output head), its layers (unrolled) and memory policy (no activation remat; see below), float32 weights and
activations, the prompts (the same token ids: BOS + prompt_tokens - 1 random ids), new-token counts (no EOS on either
side, so every row decodes all of them), sampling (T = 1, no top-k/top-p), G, beta, epsilon and KL estimator (k3 is
Tunix's `low_var_kl`), the optimizer (MaxText's own optax AdamW and schedule built from our config, after clipping by
global norm at `gradient_clipping_threshold`), the reward functions (the project's reward set scores both sides'
completions), and Tunix's KV cache (prompt + new tokens, not its default 1024).

Differences that cannot be removed (each is how the library works):
- Prefill: ours prefills each prompt once and repeats its KV cache to the samples; Tunix's sampler prefills every row
  (G rows per prompt in a rollout, N per prompt in the sampler rows).
- Decode steps: Tunix's decode loop runs one model call per new token after prefill's first draw plus one more whose
  token falls past the buffer, so T tokens cost T decode calls (ours: T - 1). Its prefill is reported as the one-token
  request minus one decode step; ours is the one-token request itself.
- KV cache: ours is sized per request (prompt bucket + new tokens); Tunix's is fixed when its sampler is built, so the
  sampler rows' one-token request attends over a cache sized for T tokens.
- Rollout log-probs: ours returns the sampler's log-probs of the drawn tokens, used as the old policy's; Tunix's GRPO
  rollout returns none (with num_iterations = 1 its loss uses the current policy's, stop-gradient). The sampler rows
  ask Tunix for log-probs too.
- Prompts and texts: Tunix's API takes and returns strings (tokenized and detokenized on the host each call, here by a
  MockVocab-style `t<id>` tokenizer); ours takes and returns token ids and decodes only for the rewards.
- Random draws: ours draws each row with its own key folded from (sample, step); Tunix draws all rows of a step with
  one key. Rewards therefore score different completions.
- Vocabulary padding: where vocab_size runs past the tokenizer's pieces (the tiny config: 1024 over 512), ours masks
  the logits of ids the tokenizer cannot decode; Tunix samples over the whole vocabulary.
- The LM head in the train step and the reference: ours computes the logits of each row's completion positions only
  (`rl_base.completion_index`); Tunix computes every position's and slices the completion's before its log-softmax
  (`get_per_token_logps` in tunix/rl/common.py), so ours runs fewer FLOPs there (the head's share of the model times
  the prompt's share of the row).
- Numerics that cost the same: MaxText's initialisers against Tunix's (its MLP kernels start at zero), and Tunix's
  Llama3 applies RoPE at timescale 1e6 whatever its config says (ours: `rope_max_timescale`); the weights and
  logits differ, the FLOPs do not.

Layers and remat: Tunix's Llama3 is an unrolled list of layers, and its remat options (per block or per decoder layer)
fail inside its own vanilla rollout (its decode loop merges the remat-wrapped model within a while loop: flax's
TraceContextError), so Tunix runs without remat. MaxText's scanned decoder always rematerialises (under
`remat_policy=none` too), so ours runs `scan_layers=false remat_policy=none` here: the same layers and no
recomputation on both sides. `maxtext_posttrain.config` keeps "none" a string, which MaxText's config reader would
turn into None and its unscanned decoder into full remat.
`scan_layers=true remat_policy=full` (the project's configs, as the README's benchmarks run) times ours with scanned
layers and full remat against Tunix without remat.

Prints a table, the median of the rounds' own GRPO step ratios (each round runs both sides), and writes one JSON
row; ratios are ours / Tunix (under 1 is faster for times, over 1 for tokens/s).
The last line is for scripts: `peers: grpo_step_ratio=<ours/Tunix> sampler_tokens_ratio=<ours/Tunix>`.

  make peers-env   # .venv-peers: a copy of .venv plus requirements/peers.txt, installed with --no-deps
  .venv-peers/bin/python -m benchmarks.peers [grpo.yml] [key=value ...] [--model=tiny|benchmark] [--repeats=5]
      [--prompts=2] [--generations=2] [--prompt_tokens=64] [--new_tokens=64] [--sampler_prompts=8]
      [--sampler_samples=4] [--sampler_new_tokens=128] [--emb_dim=256] [--num_heads=4] [--head_dim=64] [--mlp_dim=512]
      [--num_layers=2] [--vocab_size=1024] [--tunix_devices=all] [--tunix_rollout_devices=0]
      [--output=benchmark_peers.json]

Layouts. By default every role of both sides runs on all the process's devices, one step after another. Each side
can also overlap its rollouts with training, on a mesh of their own:
- ours with `rl.off_policy_steps=1`: each step dispatches the next step's rollouts, with its current weights copied
  to the sampler's devices (MaxText's `trainer_devices_fraction` / `sampler_devices_fraction`: halves by default; 1
  and 1 share all devices), then trains while they decode; the step trains on rollouts one update old (the importance
  ratio corrects for it; `rl/rollout_seconds` is then the wait). With `rl.reference_devices=sampler` the reference
  scores each rollout batch on the sampler's devices right behind its decode program, and the reference row is the
  step's wait for its log-probs after the rollouts (`rl/reference_seconds`).
- Tunix with `--tunix_rollout_devices=M`: its rollout runs on the last M devices, its actor and reference on the first
  `--tunix_devices` (default: all the others). Its learner then prepares rollouts on a thread of its own while the
  actor trains, but only between the micro-batches of one global step (one here, so nothing overlaps:
  `RLLearner._run_all_micro_batch_steps` submits `_prepare_data` for one global step's micro-batches), and copies the
  weights to the rollout model after every global step (`RLLearner.train`); that copy, waited for, counts in its step.
  Its rollouts stay on-policy.
On CPU, `XLA_FLAGS=--xla_force_host_platform_device_count=2` gives the process two devices (on the same cores):
ours then trains on one and samples on the other; `--tunix_rollout_devices=1` gives Tunix the same split, and
`--tunix_devices=1` alone runs every Tunix role synchronously on the first device.
`--prompts` must be a multiple of the device count (MaxText's per-device batch: below 1 it loads a prompt per device).

`--model=tiny` (default) is emb 256, 4 heads x 64, mlp 512, 2 layers, vocab 1024; `--model=benchmark` is the 34.6M
benchmark model of `benchmarks.harness` (emb 1024, 16 heads x 64, mlp 4096, 2 layers, vocab 512). The dim flags
override either preset; `key=value` arguments override our config, and Tunix's model and learner are built from the
resulting config.
"""

import contextlib
import dataclasses
import importlib.metadata
import json
import os
import statistics
import sys
import time
import types
import warnings

from flax import nnx
from flax.linen import partitioning as nn_partitioning
import jax
import jax.numpy as jnp
import numpy as np
import optax

from maxtext.optimizers import optimizers as maxtext_optimizers

from benchmarks import harness
from maxtext_posttrain import rollout
from maxtext_posttrain import trainer

NO_EOS = -1  # a stop id no sampler draws: every row decodes all its new tokens
MISSING_TUNIX = "run `make peers-env` and use `.venv-peers/bin/python -m benchmarks.peers`"

# Model dims as flags, and the config keys each sets.
DIM_KEYS = {
    "emb_dim": ("base_emb_dim",),
    "num_heads": ("base_num_query_heads", "base_num_kv_heads"),
    "head_dim": ("head_dim",),
    "mlp_dim": ("base_mlp_dim",),
    "num_layers": ("base_num_decoder_layers",),
    "vocab_size": ("vocab_size",),
}
# `benchmark` adds nothing: harness.BENCHMARK_MODEL's dims and grpo.yml's vocabulary (512) are the 34.6M model.
PRESETS = {
    "tiny": {"emb_dim": 256, "num_heads": 4, "head_dim": 64, "mlp_dim": 512, "num_layers": 2, "vocab_size": 1024},
    "benchmark": {},
}
KL_MODES = {"k1": "kl", "k2": "mse_kl", "k3": "low_var_kl"}  # our rl.kl_estimator -> Tunix's kl_loss_mode
PARTS = ("rollout", "reward", "reference", "train")


def import_tunix() -> types.SimpleNamespace:
  """Tunix's modules this benchmark drives; exits with one line naming how to get them when they do not import."""
  try:
    # pylint: disable=import-outside-toplevel
    from tunix.generate import sampler as tunix_sampler
    from tunix.models.llama3 import model as llama3
    from tunix.rl import common as rl_common
    from tunix.rl import rl_cluster
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout
  except ImportError as e:
    sys.exit(f"peers: Tunix is not importable ({e}); {MISSING_TUNIX}.")
  return types.SimpleNamespace(
      sampler=tunix_sampler,
      llama3=llama3,
      rl_common=rl_common,
      rl_cluster=rl_cluster,
      grpo=grpo_learner,
      base_rollout=base_rollout,
  )


class IdTokenizer:
  """Tunix's tokenizer interface (encode, decode, bos_id, eos_id, pad_id) over plain token ids, like Tunix's test
  MockVocab: a text is space-separated `t<id>` words. EOS is an id no sampler draws."""

  def __init__(self, bos_id: int):
    self._bos_id = bos_id

  def encode(self, text: str, **_) -> list[int]:
    return [int(word[1:]) for word in text.split()]

  def decode(self, ids, **_) -> str:
    return " ".join(f"t{i}" for i in ids)

  def bos_id(self) -> int:
    return self._bos_id

  def eos_id(self) -> int:
    return NO_EOS

  def pad_id(self) -> int:
    return 0


def text(ids) -> str:
  return IdTokenizer(0).decode(ids)


def random_prompts(rng, count: int, length: int, low: int, high: int, bos_id: int) -> list[list[int]]:
  """`count` prompts of `length` tokens: BOS, then random ids in [low, high)."""
  return [[bos_id] + rng.integers(low, high, size=length - 1).tolist() for _ in range(count)]


def timed_call(fn) -> float:
  start = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - start


class Ours:
  """The project's GRPO loop and rollout sampler on `config`."""

  def __init__(self, config, sampling: rollout.SamplingParams):
    self.config = config
    self.loop = loop = trainer.setup(config)
    self.sampling = sampling
    self.encoder = loop.objective.encoder
    self.sampler = loop.sampler()
    start = self.sampler.start
    # The objective stops rows at the tokenizer's EOS; no stop id here, so every rollout row decodes all new tokens.
    self.sampler.start = lambda params, p, max_new, eos_id, *a, **k: start(params, p, max_new, NO_EOS, *a, **k)
    self.num_params = int(sum(x.size for x in jax.tree.leaves(loop.primary.state.model.filter(nnx.Param))))
    self.answers = []
    self.batch = None  # the last GRPO step's training rows
    self._logps_step = None

  def use_prompts(self, prompts: list[list[int]]) -> None:
    """Every step samples `prompts` (the token ids Tunix's side gets), in place of the dataset prompts at the indices
    the prompt iterator yields (still loaded each step); the rewards read the first dataset prompts' texts and
    answers."""
    objective = self.loop.objective
    dataset = objective.train_prompts
    self.answers = [dataset.answers[i] for i in range(len(prompts))]
    objective.train_prompts = types.SimpleNamespace(
        prompt_ids=[tuple(p) for p in prompts],
        prompt_texts=[dataset.prompt_texts[i] for i in range(len(prompts))],
        answers=self.answers,
    )
    objective.indices = lambda batch: list(range(len(prompts)))

  @contextlib.contextmanager
  def scope(self):
    """Our programs' mesh and logical axis rules, as `benchmarks.grpo_vs_pretrain` runs them."""
    with jax.set_mesh(self.loop.mesh), nn_partitioning.axis_rules(self.config.logical_axis_rules):
      yield

  def grpo_step(self) -> dict[str, float]:
    loop = self.loop
    with self.scope():
      start = time.perf_counter()
      batch = loop.train_batches.load_next_batch() if loop.objective.wants_batch(loop) else None
      batch = self.batch = loop.objective.before_step(loop, batch)
      train_start = time.perf_counter()
      train_metrics = loop.primary.train_step(batch, loop.frozen_states())
      jax.block_until_ready((loop.primary.state, train_metrics))
      end = time.perf_counter()
    loop.step += 1
    metrics = loop.objective.step_metrics
    assert metrics["rl/completion_length_mean"] == config_new_tokens(self.config), metrics
    return {
        "step": end - start,
        "rollout": metrics["rl/rollout_seconds"],
        "reward": metrics["rl/reward_seconds"],
        "reference": metrics.get("rl/reference_seconds", 0.0),
        "train": end - train_start,
    }

  def logps_pass(self) -> float:
    """Seconds of one log-probs pass (module docstring) on the last GRPO step's rows with the current weights."""
    graphdef, params, rest = nnx.split(self.loop.primary.model(), nnx.Param, ...)
    if self._logps_step is None:
      objective = self.loop.objective

      def completion_logps(params, rest, batch):
        model = nnx.merge(graphdef, params, rest, copy=True)
        logps, _, _, window = objective.policy_window(model, batch, is_train=True)
        return jnp.sum(logps * window["completion_mask"])

      self._logps_step = jax.jit(jax.value_and_grad(completion_logps))
    with self.scope():
      return timed_call(lambda: self._logps_step(params, rest, self.batch))

  @property
  def layout(self) -> dict:
    return {
        "trainer_devices": self.loop.mesh.devices.size,
        "sampler_devices": self.sampler.mesh.devices.size,
        "shared": set(self.loop.mesh.devices.flat) == set(self.sampler.mesh.devices.flat),
        "off_policy_steps": self.config.rl.off_policy_steps,
    }

  def sequences(self) -> np.ndarray:
    """[rows, prompt + completion tokens] the last GRPO step's sequences (every completion runs to the token budget)."""
    inputs, targets = jax.device_get((self.batch["inputs"], self.batch["targets"]))
    return np.concatenate([inputs[:, :1], targets[:, :-1]], axis=1)

  def sample(self, prompts: list[list[int]], num_samples: int, new_tokens: int, seed: int) -> float:
    params = self.loop.policy_params()

    def run():
      out = self.sampler.sample(
          params, prompts, new_tokens, NO_EOS, jax.random.key(seed), self.sampling, num_samples=num_samples
      )
      assert (out.lengths == new_tokens).all()
      return out.tokens

    with self.scope():
      return timed_call(run)


def config_new_tokens(config) -> int:
  return config.max_target_length - config.max_prefill_predict_length


class Tunix:
  """Tunix's GRPOLearner (vanilla rollout) and Sampler on a Tunix Llama3 built at our config's dims."""

  def __init__(
      self,
      tunix,
      config,
      schedule,
      prompts: list[list[int]],
      answers: list[str],
      reward_set,
      sampler_cache: int,
      devices: list,
      rollout_devices: list,
  ):
    """Actor and reference on one fsdp mesh over `devices`; the rollout on that mesh too, or on a mesh of its own
    over `rollout_devices` when given (Tunix's asynchronous layout: see the module docstring)."""
    self.tunix = tunix
    rl, new_tokens = config.rl, config_new_tokens(config)
    prompt_tokens = config.max_prefill_predict_length
    mesh = lambda devices: jax.sharding.Mesh(np.array(devices).reshape(len(devices), 1), ("fsdp", "tp"))
    self.mesh = mesh(devices)
    rollout_mesh = mesh(rollout_devices) if rollout_devices else self.mesh
    self.layout = {
        "actor_and_reference_devices": len(devices),
        "rollout_devices": len(rollout_devices or devices),
        "shared": not rollout_devices,
    }
    # No remat: Tunix's remat options break its own vanilla rollout (see the module docstring).
    remat = tunix.llama3.RematConfig.NONE
    self.remat = remat.name
    model_config = tunix.llama3.ModelConfig(
        num_layers=config.num_decoder_layers,
        vocab_size=config.vocab_size,
        embed_dim=config.emb_dim,
        hidden_dim=config.mlp_dim,
        num_heads=config.num_query_heads,
        head_dim=config.head_dim,
        num_kv_heads=config.num_kv_heads,
        rope_theta=config.rope_max_timescale,
        norm_eps=config.normalization_layer_epsilon,
        weight_tying=config.logits_via_embedding,
        remat_config=remat,
    )
    actor = tunix.llama3.Llama3(model_config, rngs=nnx.Rngs(params=0))
    reference = tunix.llama3.Llama3(model_config, rngs=nnx.Rngs(params=0))
    self.num_params = int(sum(x.size for x in jax.tree.leaves(nnx.state(actor, nnx.Param))))
    self.tokenizer = IdTokenizer(bos_id=prompts[0][0])
    self.model_config = model_config
    self.sampler_cache = sampler_cache
    # MaxText's own optimizer and schedule from our config; MaxText clips gradients in its train step, Tunix's
    # trainer applies only the optimizer, so the clipping leads the chain.
    tx = maxtext_optimizers.get_optimizer(config, schedule)
    if config.gradient_clipping_threshold > 0:
      tx = optax.chain(optax.clip_by_global_norm(config.gradient_clipping_threshold), tx)
    role = tunix.rl_cluster.Role
    self.rollout_config = tunix.base_rollout.RolloutConfig(
        max_tokens_to_generate=new_tokens,
        max_prompt_length=prompt_tokens,
        kv_cache_size=prompt_tokens + new_tokens,
        temperature=config.decode_sampling_temperature,
        top_p=1.0,
        top_k=None,
        eos_tokens=[NO_EOS],
    )
    cluster = tunix.rl_cluster.RLCluster(
        actor=actor,
        reference=reference,
        tokenizer=self.tokenizer,
        cluster_config=tunix.rl_cluster.ClusterConfig(
            role_to_mesh={role.ACTOR: self.mesh, role.REFERENCE: self.mesh, role.ROLLOUT: rollout_mesh},
            rollout_engine="vanilla",
            offload_to_cpu=False,
            training_config=tunix.rl_cluster.RLTrainingConfig(
                actor_optimizer=tx, eval_every_n_steps=10**9, max_steps=10**9, pbar_description=None
            ),
            rollout_config=self.rollout_config,
        ),
    )
    algo = tunix.grpo.GRPOConfig(
        num_generations=rl.num_generations,
        num_iterations=1,
        beta=rl.grpo_beta,
        epsilon=rl.grpo_epsilon,
        kl_loss_mode=KL_MODES[rl.kl_estimator],
        loss_agg_mode=rl.loss_agg_mode,
    )
    if rl.epsilon_high is not None and "epsilon_high" in {f.name for f in dataclasses.fields(algo)}:
      algo.epsilon_high = rl.epsilon_high

    def rewards(prompts, completions, answer, **_):
      """The project's reward set (the same functions and weights as our side)."""
      return reward_set.score(list(prompts), list(completions), [str(a) for a in answer])[0].tolist()

    self.learner = tunix.grpo.GRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=[rewards])
    self.cluster = cluster
    # Arrays, as a grain batch gives them: the learner repeats every column G times along its first axis.
    self.batch = {"prompts": np.array([text(p[1:]) for p in prompts]), "answer": np.array(answers)}
    self.should_sync_weights = bool(self.learner.should_sync_weights)
    self.times = {}
    cluster.generate = self._timed("rollout", cluster.generate)
    cluster.get_ref_per_token_logps = self._timed("reference", cluster.get_ref_per_token_logps, wait=True)
    cluster.update_actor = self._timed("train", cluster.update_actor)
    sync_weights = cluster.sync_weights  # called only with a rollout mesh of its own

    def synced_weights():
      sync_weights()
      jax.block_until_ready(nnx.state(cluster.rollout.model()))  # the copies it queued, done

    cluster.sync_weights = self._timed("sync", synced_weights)
    compute_rewards = self.learner._compute_rewards  # pylint: disable=protected-access
    self.learner._compute_rewards = self._timed("reward", compute_rewards)
    self._sampler = None
    self._logps_step = None

  def _timed(self, name, fn, wait=False):
    def call(*args, **kwargs):
      start = time.perf_counter()
      out = fn(*args, **kwargs)
      if wait:  # Tunix does not wait for the reference log-probs before it scores the rewards
        jax.block_until_ready(out)
      self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start
      self.times[f"{name}_end"] = time.perf_counter()
      return out

    return call

  def grpo_step(self) -> dict[str, float]:
    self.times.clear()
    start = time.perf_counter()
    self.learner.train([self.batch])
    call = time.perf_counter() - start
    end = self.times.get("sync_end", self.times["train_end"])  # the rollout's copy of the weights is part of the step
    return {"step": end - start, "call": call} | {part: self.times.get(part, 0.0) for part in PARTS}

  def logps_pass(self, sequences: np.ndarray) -> float:
    """Seconds of one log-probs pass (module docstring) on `sequences` (ours: the same token ids) through Tunix's
    `get_per_token_logps` on the actor, with its causal mask, over the completion's tokens."""
    graphdef, params, rest = nnx.split(self.cluster.actor_trainer.model, nnx.Param, ...)
    if self._logps_step is None:
      completion_tokens = self.rollout_config.max_tokens_to_generate

      def completion_logps(params, rest, tokens):
        rows, length = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (rows, length))
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((length, length), jnp.bool_)), (rows, length, length))
        model = nnx.merge(graphdef, params, rest, copy=True)
        return jnp.sum(self.tunix.rl_common.get_per_token_logps(model, tokens, positions, mask, completion_tokens))

      self._logps_step = jax.jit(jax.value_and_grad(completion_logps))
    tokens = jnp.asarray(sequences, jnp.int32)
    with self.mesh:
      return timed_call(lambda: self._logps_step(params, rest, tokens))

  def sample(self, prompts: list[list[int]], num_samples: int, new_tokens: int, seed: int) -> float:
    if self._sampler is None:
      self._sampler = self.tunix.sampler.Sampler(
          self.cluster.actor_trainer.model,
          self.tokenizer,
          self.tunix.sampler.CacheConfig(
              cache_size=self.sampler_cache,
              num_layers=self.model_config.num_layers,
              num_kv_heads=self.model_config.num_kv_heads,
              head_dim=self.model_config.head_dim,
          ),
      )
    rows = [text(p[1:]) for p in prompts for _ in range(num_samples)]

    def run():
      out = self._sampler(
          input_strings=rows,
          max_generation_steps=new_tokens,
          max_prompt_length=len(prompts[0]),
          echo=False,
          temperature=self.rollout_config.temperature,
          top_p=1.0,
          seed=seed,
          return_logprobs=True,
      )
      assert all(len(t) == new_tokens for t in out.tokens)
      return out.tokens

    with warnings.catch_warnings(), self.mesh:  # RLCluster runs Tunix's sampler under `with mesh:` too
      warnings.simplefilter("ignore", DeprecationWarning)
      return timed_call(run)


def summarize(grpo: list[dict], full: list[float], one: list[float], rows: int, new_tokens: int, decode_calls: int):
  """Medians of a side's step and its parts (`other`: the step less its timed parts, host work between them), of its
  log-probs pass, sampler throughput and its prefill / per-token decode split. `decode_calls` is the number of
  decode-step model calls in the one-token request (ours 0, Tunix 1)."""
  out = {f"{part}_s": statistics.median([t[part] for t in grpo]) for part in ("step", *PARTS)}
  out["logps_pass_s"] = statistics.median([t["logps_pass"] for t in grpo])
  # Per step, then the median: the parts above are medians of their own.
  out["other_s"] = statistics.median([t["step"] - sum(t[part] for part in PARTS) for t in grpo])
  total, single = statistics.median(full), statistics.median(one)
  decode = (total - single) / (new_tokens - 1)
  out |= {
      "sampler_s": total,
      "sampler_tokens_per_s": rows * new_tokens / total,
      "one_token_request_s": single,
      "prefill_s": single - decode_calls * decode,
      "decode_per_token_s": decode,
  }
  return out


TABLE = (
    ("GRPO step (s)", "step_s", 1.0),
    ("  rollout (s)", "rollout_s", 1.0),
    ("  rewards (s)", "reward_s", 1.0),
    ("  reference (s)", "reference_s", 1.0),
    ("  train (s)", "train_s", 1.0),
    ("  other (s)", "other_s", 1.0),
    ("log-probs fwd+bwd (s)", "logps_pass_s", 1.0),
    ("sampler tokens/s", "sampler_tokens_per_s", 1.0),
    ("  prefill (ms)", "prefill_s", 1e3),
    ("  decode per token (ms)", "decode_per_token_s", 1e3),
)


def main(argv):
  args = harness.parse(argv, default_config="grpo.yml")
  tunix = import_tunix()
  flag = lambda name, default: int(args.flag(name, str(default)))
  model = args.flag("model", "tiny")
  if model not in PRESETS:
    raise ValueError(f"--model={model}: expected one of {sorted(PRESETS)}.")
  dims = PRESETS[model] | {name: int(args.flags[name]) for name in DIM_KEYS if name in args.flags}
  repeats, prompts, generations = flag("repeats", 5), flag("prompts", 2), flag("generations", 2)
  prompt_tokens, new_tokens = flag("prompt_tokens", 64), flag("new_tokens", 64)
  sampler_prompts, sampler_samples = flag("sampler_prompts", 8), flag("sampler_samples", 4)
  sampler_new_tokens = flag("sampler_new_tokens", 128)
  if sampler_new_tokens < 2:
    raise ValueError("--sampler_new_tokens must be at least 2: the prefill/decode split times 1 new token against it.")
  output = args.flag("output", "benchmark_peers.json")
  num_devices = jax.device_count()
  if prompts % num_devices:
    raise ValueError(f"--prompts={prompts}: a multiple of the {num_devices} devices (MaxText's per-device batch).")
  rollout_devices = flag("tunix_rollout_devices", 0)
  tunix_devices = flag("tunix_devices", num_devices - rollout_devices)
  if not (0 <= rollout_devices < num_devices and 1 <= tunix_devices <= num_devices - rollout_devices):
    raise ValueError(
        f"--tunix_devices={tunix_devices} --tunix_rollout_devices={rollout_devices}: Tunix's actor and reference take "
        f"the first devices (at least 1) and its rollout the last ones, apart, of the {num_devices}."
    )
  keys = [f"{key}={value}" for name, value in dims.items() for key in DIM_KEYS[name]]
  keys += [
      f"per_device_batch_size={prompts // num_devices}",
      f"rl.num_generations={generations}",
      f"max_prefill_predict_length={prompt_tokens}",
      f"max_target_length={prompt_tokens + new_tokens}",
      "rl.grpo_beta=0.04",
      # Layers unrolled and no remat, as Tunix's Llama3 runs in its rollout (see the module docstring).
      "scan_layers=false",
      "remat_policy=none",
  ]
  config = args.config("peers", *keys)
  sampling = rollout.SamplingParams.from_config(config)
  if (sampling.strategy, sampling.top_k, sampling.top_p) != ("weighted", 0, 1.0):
    raise ValueError(f"{sampling}: the comparison samples softmax(logits / T) on both sides (weighted, no top-k/p).")
  if config.global_batch_size_to_load != prompts:
    raise ValueError(
        f"{config.global_batch_size_to_load} prompts per step on {jax.device_count()} devices, not {prompts}."
    )

  ours = Ours(config, sampling)
  bos_id = ours.encoder.bos_id if ours.encoder.bos_id is not None else 1
  rng = np.random.default_rng(0)
  grpo_prompts = random_prompts(rng, prompts, prompt_tokens, 3, ours.loop.objective.num_pieces, bos_id)
  sampler_prompt_ids = random_prompts(rng, sampler_prompts, prompt_tokens, 3, ours.loop.objective.num_pieces, bos_id)
  ours.use_prompts(grpo_prompts)
  peer = Tunix(
      tunix,
      config,
      ours.loop.primary.learning_rate_schedule,
      grpo_prompts,
      ours.answers,
      ours.loop.objective.rewards,
      sampler_cache=prompt_tokens + sampler_new_tokens,
      devices=jax.devices()[:tunix_devices],
      rollout_devices=jax.devices()[num_devices - rollout_devices :] if rollout_devices else [],
  )
  sides = {"ours": ours, "tunix": peer}
  grpo = {name: [] for name in sides}
  full = {name: [] for name in sides}
  one = {name: [] for name in sides}
  # Alternating, the side that goes first swapping every round; two warm-up rounds compile every program.
  for repeat in range(-2, repeats):
    for name in sorted(sides, reverse=repeat % 2 == 1):
      times = sides[name].grpo_step()
      # The log-probs pass right after the step, in the same round: the same sequences (ours) on both sides.
      times["logps_pass"] = ours.logps_pass() if name == "ours" else peer.logps_pass(ours.sequences())
      if repeat >= 0:
        grpo[name].append(times)
  for repeat in range(-1, repeats):
    for name in sorted(sides, reverse=repeat % 2 == 1):
      seed = repeat + 1
      total = sides[name].sample(sampler_prompt_ids, sampler_samples, sampler_new_tokens, seed)
      single = sides[name].sample(sampler_prompt_ids, sampler_samples, 1, seed)
      if repeat >= 0:
        full[name].append(total)
        one[name].append(single)

  rows = sampler_prompts * sampler_samples
  results = {
      name: summarize(grpo[name], full[name], one[name], rows, sampler_new_tokens, decode_calls=int(name == "tunix"))
      for name in sides
  }
  ratios = {key: results["ours"][key] / results["tunix"][key] for _, key, _ in TABLE if results["tunix"][key]}
  # Each round runs both sides back to back, so a spell of the machine's that slows one round slows both sides'
  # steps in it: the median of the rounds' own ratios is the steadier figure when spells hit one side's medians.
  ratios["step_per_round"] = statistics.median(o["step"] / t["step"] for o, t in zip(grpo["ours"], grpo["tunix"]))
  row = {
      "benchmark": "peers",
      "tunix_version": importlib.metadata.version("google-tunix"),
      "model": model,
      "model_parameters": {name: side.num_params for name, side in sides.items()},
      "dims": {
          "emb_dim": config.emb_dim,
          "num_heads": config.num_query_heads,
          "num_kv_heads": config.num_kv_heads,
          "head_dim": config.head_dim,
          "mlp_dim": config.mlp_dim,
          "num_layers": config.num_decoder_layers,
          "vocab_size": config.vocab_size,
          "dtype": str(config.dtype),
          "remat": {"ours": config.remat_policy, "tunix": peer.remat},
          "scan_layers": {"ours": bool(config.scan_layers), "tunix": False},
      },
      "grpo": {
          "prompts": prompts,
          "generations": generations,
          "prompt_tokens": prompt_tokens,
          "new_tokens": new_tokens,
          "beta": config.rl.grpo_beta,
          "kl_estimator": config.rl.kl_estimator,
          "optimizer": config.opt_type,
          "learning_rate": config.learning_rate,
          "temperature": config.decode_sampling_temperature,
          "tunix_syncs_weights": peer.should_sync_weights,
          "off_policy_steps": config.rl.off_policy_steps,
      },
      "sampler": {
          "prompts": sampler_prompts,
          "samples_per_prompt": sampler_samples,
          "prompt_tokens": prompt_tokens,
          "new_tokens": sampler_new_tokens,
      },
      "ours": results["ours"],
      "tunix": results["tunix"],
      "ratios": ratios,
      "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
      "layout": {"ours": ours.layout, "tunix": peer.layout},
      "repeats": repeats,
      "times_s": {name: {"grpo": grpo[name], "sampler": full[name], "one_token_request": one[name]} for name in sides},
  }
  with open(output, "w", encoding="utf-8") as f:
    json.dump([row], f, indent=2)

  print(
      f"GRPO and sampler, ours against Tunix: {model} model ({ours.num_params / 1e6:.2f}M ours, "
      f"{peer.num_params / 1e6:.2f}M Tunix {row['tunix_version']}), GRPO {prompts} prompts x G={generations}, "
      f"{prompt_tokens} + {new_tokens} tokens, "
      f"beta {config.rl.grpo_beta}; sampler {sampler_prompts} x {sampler_samples} x {sampler_new_tokens} new tokens; "
      f"medians of {repeats}, {row['devices']}; devices ours {row['layout']['ours']}, Tunix {row['layout']['tunix']}"
  )
  print(f"| {'measure':<24} | {'ours':>10} | {'Tunix':>10} | {'ours/Tunix':>10} |")
  print(f"| {'-' * 24} | {'-' * 10}:| {'-' * 10}:| {'-' * 10}:|")
  for label, key, scale in TABLE:
    ratio = f"{ratios[key]:.3f}" if key in ratios else "-"
    cells = [f"{results[name][key] * scale:.4g}" for name in sides]
    print(f"| {label:<24} | {cells[0]:>10} | {cells[1]:>10} | {ratio:>10} |")
  print(f"GRPO step ratio, median of the {repeats} rounds' own: {ratios['step_per_round']:.3f}")
  print(f"wrote {os.path.abspath(output)}")
  print(f"peers: grpo_step_ratio={ratios['step_s']:.3f} sampler_tokens_ratio={ratios['sampler_tokens_per_s']:.3f}")


if __name__ == "__main__":
  main(sys.argv)

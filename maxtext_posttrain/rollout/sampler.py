"""Sampling with MaxText's own decode path: one batched prefill, then an on-device autoregressive loop over the KV cache.

This is the path MaxEngine takes (prefill-mode model call, then autoregressive-mode calls reading and extending
MaxText's `KVCache`), without MaxEngine itself: MaxEngine needs JetStream, prefills one prompt at a time and
round-trips to the host for every token; MaxText 0.2.5's OfflineEngine also reuses one PRNG key for every copy of
a prompt and scores log-probs without the temperature. Here a whole batch of ragged prompts is prefilled once in one
call (right padding, masked by segment ids exactly as MaxText masks packed or padded prefill), each prompt's cache
is repeated to its N samples, and the token loop is a `jax.lax.while_loop` inside one jitted program that stops as
soon as every sequence has produced a stop token. Tokens are drawn with MaxText's `inference_utils.sampling`
(greedy, weighted, topk, nucleus, composite), each row with its own key folded from (sample, step).

Sizes are static per bucket: prompts are padded to a power of two (at most `max_prefill_predict_length`), the
prefill part of the cache has that length and the autoregressive part `max_new_tokens` (not `max_target_length`),
and the decode graphs and program are built and compiled once per (batch, samples, prompt bucket, max_new_tokens,
sampling settings) and reused.

The policy's weights are read in place: `sample` takes the trainer's `nnx.State` of `nnx.Param` as a jit argument,
so on a shared mesh there is no host round trip; params laid out for another mesh (a trainer mesh that is not the
rollout mesh) are resharded onto this sampler's mesh with one `jax.device_put`. The decode graphs are built from
the same config, with one change when the trainer scans its layers: decoding runs an unscanned graph and the stacked
weights are sliced per layer once per call inside the program (`_unscan`), because a scan inside the token loop
re-slices every layer's weights on every token. Where the slices do not map onto the unscanned model (an unusual
layer stack), the decode graph stays scanned and takes the params as they are.

Two choices make the token loop cheap on a CPU, where it runs op by op: a config with MaxText's default KV-cache
layout decodes with (batch, heads, sequence, kv) on a CPU mesh (`_CPU_CACHE_AXIS_ORDER`: no per-token transposes of
the whole cache, an in-place update), and greedy and weighted draws take their argmax as a max and a min (`_argmax`)
instead of XLA's (value, index) reduction; both change no token (tested against MaxText's layout and `sampling`).
`start` returns as soon as the program is dispatched (RL's `rl.off_policy_steps` samples ahead with it).
"""

from collections.abc import Callable
import dataclasses
import functools
import math

from flax import nnx
from flax import linen as nn
from flax.linen import partitioning as nn_partitioning
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np

from maxtext.common.common_types import DECODING_ACTIVE_SEQUENCE_INDICATOR, MODEL_MODE_AUTOREGRESSIVE, MODEL_MODE_PREFILL
from maxtext.configs import pyconfig
from maxtext.inference import inference_utils
from maxtext.utils import max_logging
from maxtext.utils import model_creation_utils
from maxtext_posttrain import config as config_lib
from maxtext_posttrain.data import pipeline
from maxtext_posttrain.losses import logprobs as logprobs_lib

# Fills the prompt tail and the positions after EOS; never attended to (segment id 0) nor returned.
_PAD_ID = 0


@dataclasses.dataclass(frozen=True)
class _DecodeGraphs:
  """What the decode program of one bucket is traced from."""

  num_samples: int
  max_new_tokens: int
  sampling: "SamplingParams"
  prefill_graph: nnx.GraphDef
  autoregressive_graph: nnx.GraphDef
  abstract_params: nnx.State  # ShapeDtypeStructs of the decode model's params (unscanned when `unscan`)
  unscan: bool  # the policy's scanned params are split per layer inside the program (see `_unscan`)
  abstract_prefill_cache: nnx.State  # ShapeDtypeStructs (with shardings) of the zero cache prefill starts from
  abstract_cache: nnx.State  # the same for the decode loop's cache, N rows per prompt
  # Builds the decode model; the program runs it for the model's remaining state (RNG streams), which nnx.merge needs
  # as values. Built inside the program, so building the sampler runs nothing and the program lowers from abstract
  # inputs alone (`Sampler.lower`); XLA drops the unused weight initialisers.
  create_model: Callable[[], nnx.Module]


# MaxText's default KV-cache layout (sequence, heads, batch, kv) is laid out for TPU; on CPU the decode step then
# transposes every layer's whole cache to (batch, heads, ...) for the attention dots on every token, and the cache
# update is a copy rather than in place. Stored as (batch, heads, sequence, kv), the attention reads the cache as it
# lies: the tiny config's decode step (32 rows, 64 + 128 cache) halves on CPU. Only a config that keeps MaxText's
# default is changed; the axis order changes no value (the same tokens, log-probs within float32 rounding).
_MAXTEXT_CACHE_AXIS_ORDER = "1,2,0,3"
_CPU_CACHE_AXIS_ORDER = "0,2,1,3"


def _decode_config(
    config: pyconfig.HyperParameters,
    batch: int,
    prefill_length: int,
    max_new_tokens: int,
    scan_layers: bool,
    platform: str,
) -> pyconfig.HyperParameters:
  """The training config with the cache sized for one (batch, prompt bucket, max_new_tokens) shape.

  MaxText sizes the prefill cache as `max_prefill_predict_length`, the autoregressive cache as
  `max_target_length - max_prefill_predict_length` and its batch as `micro_batch_size_to_train_on`, all read at
  model construction; nothing else in a model's weights depends on them for the decoder blocks this targets (the
  unscanned decode graph is only used when its params line up with the policy's). The copy skips validation on purpose, as MaxText's own `verify_and_sync_scan_layers` does for its
  config override. On a CPU mesh (`platform`, the rollout mesh's), a config that keeps MaxText's default KV-cache
  layout decodes with `_CPU_CACHE_AXIS_ORDER`.
  """
  layout = {}
  if platform == "cpu" and all(
      getattr(config, key) == _MAXTEXT_CACHE_AXIS_ORDER for key in ("prefill_cache_axis_order", "ar_cache_axis_order")
  ):
    layout = {key: _CPU_CACHE_AXIS_ORDER for key in ("prefill_cache_axis_order", "ar_cache_axis_order")}
  return config_lib.with_overrides(
      config,
      max_prefill_predict_length=prefill_length,
      max_target_length=prefill_length + max_new_tokens,
      micro_batch_size_to_train_on=batch,
      scan_layers=scan_layers,
      **layout,
  )


def _batch_multiple(config: pyconfig.HyperParameters, mesh: jax.sharding.Mesh) -> int:
  """How many ways the batch dimension of the decode inputs is sharded; the batch is padded to a multiple of it."""
  batch_axis = config.input_data_sharding_logical_axes[0]
  (mesh_axes,) = nn.logical_to_mesh_axes((batch_axis,), config.logical_axis_rules)
  if mesh_axes is None:
    return 1
  if isinstance(mesh_axes, str):
    mesh_axes = (mesh_axes,)
  return int(np.prod([mesh.shape[axis] for axis in mesh_axes]))


def _check_params_line_up(params: nnx.State, abstract_params: nnx.State) -> None:
  """Fails naming the first differing paths when the policy's params are not the params this config's model has."""
  got = {path: (tuple(v.shape), v.dtype) for path, v in jax.tree_util.tree_flatten_with_path(params)[0]}
  want = {path: (tuple(v.shape), v.dtype) for path, v in jax.tree_util.tree_flatten_with_path(abstract_params)[0]}
  if got == want:
    return
  missing = sorted(jax.tree_util.keystr(p) for p in want.keys() - got.keys())
  extra = sorted(jax.tree_util.keystr(p) for p in got.keys() - want.keys())
  differ = sorted(
      f"{jax.tree_util.keystr(p)}: {got[p]} vs {want[p]}" for p in got.keys() & want.keys() if got[p] != want[p]
  )
  raise ValueError(
      "The params do not line up with the model this config builds (pass nnx.state(model, nnx.Param) of a model "
      "built from the same config): "
      f"missing {missing[:5]}, unexpected {extra[:5]}, shape/dtype differs {differ[:5]}."
  )


def _unscanned_paths(params: nnx.State) -> dict[tuple, tuple[tuple, int, int]]:
  """Per-layer param path -> (scanned path, scan axis, layer index), for the layers MaxText stacks when scanning.

  With `scan_layers=true` a stack of identical layers is one set of params under the stack's partition name (e.g.
  `decoder/layers`, the layer index on the variable's `param_scan_axis`); with `scan_layers=false` the same weights
  are per layer under `<name>_<i>` (`decoder/layers_0`, ...). Other params keep their path.
  """
  paths = {}
  for path, variable in nnx.to_flat_state(params):
    metadata = variable.get_metadata()
    name = metadata.get(nnx.PARTITION_NAME)
    if name is None or name not in path or "param_scan_axis" not in metadata:
      paths[path] = (path, -1, -1)
      continue
    axis, at = metadata["param_scan_axis"], path.index(name)
    for i in range(variable.get_value().shape[axis]):
      paths[path[:at] + (f"{name}_{i}",) + path[at + 1 :]] = (path, axis, i)
  return paths


def _maps_onto(abstract_params: nnx.State, abstract_unscanned: nnx.State) -> bool:
  """Whether `_unscan` turns params shaped like `abstract_params` into exactly the unscanned model's params."""
  flat = dict(nnx.to_flat_state(abstract_params))
  got = {}
  for path, (source, axis, _) in _unscanned_paths(abstract_params).items():
    shape = flat[source].get_value().shape
    got[path] = shape if axis < 0 else shape[:axis] + shape[axis + 1 :]
  return got == {path: variable.get_value().shape for path, variable in nnx.to_flat_state(abstract_unscanned)}


def _unscan(params: nnx.State, abstract_unscanned: nnx.State) -> nnx.State:
  """The policy's scanned params as the unscanned decode model's params: per-layer slices, taken once per call.

  Decoding one token at a time runs the layer stack once per token; scanned, every step re-slices every layer's
  weights out of the stacked arrays inside the loop (several times slower per token on CPU). Slicing once before
  the loop leaves the loop with plain per-layer weights.
  """
  flat = dict(nnx.to_flat_state(params))
  sources = _unscanned_paths(params)
  unscanned = []
  for path, variable in nnx.to_flat_state(abstract_unscanned):
    source, axis, layer = sources[path]
    value = flat[source].get_value()
    unscanned.append((path, variable.replace(value=value if axis < 0 else jnp.take(value, layer, axis=axis))))
  return nnx.from_flat_state(unscanned)


# MaxText's `decode_sampling_strategy` values (`inference_utils.sampling`).
STRATEGIES = ("greedy", "weighted", "nucleus", "topk", "composite")

# The smallest prompt bucket: shorter buckets would only multiply the compiled programs.
_MIN_PROMPT_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How tokens are drawn, with MaxText's meaning of `decode_sampling_*` (`inference_utils.sampling`).

  `weighted` samples softmax(logits / T); `topk` keeps the k largest logits, then applies T; `nucleus` keeps the
  smallest set of tokens whose untempered probability reaches top_p, then applies T (MaxText's order; at T = 1,
  the usual setting for RL, the order does not matter); `composite` is top-k, then top-p within it, then T.
  Log-probs are always those of softmax(logits / T) (see `losses/logprobs.py`), T = `temperature` for every
  strategy including greedy. Ids the tokenizer cannot decode (vocabulary padding) are masked out before any of this.
  """

  strategy: str = "greedy"
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  @classmethod
  def from_config(cls, config: pyconfig.HyperParameters, **overrides) -> "SamplingParams":
    """MaxText's `decode_sampling_*` keys, with its `-1` (nucleus off) read as top_p = 1."""
    strategy = config.decode_sampling_strategy
    top_p = config.decode_sampling_nucleus_p
    values = {
        "strategy": getattr(strategy, "value", strategy),
        "temperature": config.decode_sampling_temperature,
        "top_k": config.decode_sampling_top_k,
        "top_p": 1.0 if top_p == -1 else top_p,
    }
    return cls(**(values | overrides))

  def __post_init__(self):
    if self.strategy not in STRATEGIES:
      raise config_lib.ConfigError(f"decode_sampling_strategy must be one of {STRATEGIES}, got {self.strategy!r}.")
    if not self.temperature > 0:
      raise config_lib.ConfigError(f"decode_sampling_temperature must be > 0, got {self.temperature}.")
    if self.strategy in ("topk", "composite") and self.top_k < 1:
      raise config_lib.ConfigError(f"decode_sampling_top_k must be >= 1 for {self.strategy}, got {self.top_k}.")
    if not 0.0 < self.top_p <= 1.0:
      raise config_lib.ConfigError(f"decode_sampling_nucleus_p (top_p) must be in (0, 1], got {self.top_p}.")

  def draw(self, logits: jax.Array, keys: jax.Array) -> jax.Array:
    """One token per row of `logits` [rows, vocab], row i drawn with `keys[i]`.

    Greedy and weighted draw exactly the tokens MaxText's `sampling` draws (weighted: `jax.random.categorical`, i.e.
    the argmax of logits / T plus Gumbel noise from the row's key), with the argmax taken as `_argmax` does.
    """
    if self.strategy == "greedy":
      return _argmax(logits)
    if self.strategy == "weighted":
      logits = logits.astype(jnp.float32) / self.temperature
      noise = jax.vmap(lambda key: jax.random.gumbel(key, logits.shape[-1:], logits.dtype))(keys)
      return _argmax(logits + noise)
    strategy = self.strategy
    if self.top_p == 1.0:  # no nucleus truncation; MaxText's cut-off index would run past the vocabulary
      strategy = {"nucleus": "weighted", "composite": "topk"}.get(strategy, strategy)
    draw_row = functools.partial(
        inference_utils.sampling,
        algorithm=strategy,
        topk=self.top_k,
        nucleus_topp=self.top_p,
        temperature=self.temperature,
    )
    return jax.vmap(draw_row)(logits.astype(jnp.float32), keys).astype(jnp.int32)


def _argmax(x: jax.Array) -> jax.Array:
  """`jnp.argmax(x, -1)` as int32 (the first index of the maximum), as a max and a min over the last axis: XLA CPU
  runs argmax's (value, index) reduction element by element, about 1/10 of the decode step on the tiny config."""
  ids = jnp.arange(x.shape[-1], dtype=jnp.int32)
  first = jnp.min(jnp.where(x == jnp.max(x, axis=-1, keepdims=True), ids, x.shape[-1]), axis=-1)
  return jnp.minimum(first, x.shape[-1] - 1)  # a row of NaNs: the last id rather than one past the vocabulary


@dataclasses.dataclass
class Rollouts:
  """Completions of B prompts x N samples, prompt-major: row `i * num_samples + j` is sample j of prompt i.

  Attributes:
    prompts: the prompt tokens each row continued (after left truncation), one list per row.
    tokens: [rows, max_new_tokens] int32 completion tokens, `pad_id` after each row's end; a stop token that ended
      a row is included.
    logprobs: [rows, max_new_tokens] float32 log-probs of `tokens` under softmax(logits / T) over the ids the
      tokenizer decodes; 0 after the end.
    lengths: [rows] completion lengths (stop token included).
    finish_reasons: "eos" (ended on EOS or a stop token) or "length" (ran out of max_new_tokens), per row.
    num_truncated_prompts: prompts longer than max_prefill_predict_length that lost their left end.
    sampled: with tools (`rollout.tools`), [rows, max_new_tokens] int8: 1 where the policy sampled the token, 0 where
      a tool's answer was inserted (and after the end); None when the policy sampled every token.
    tool_calls: with tools, [rows] the calls each row made that a tool answered.
    tool_errors: with tools, [rows] the calls each row made whose tool raised, left unanswered (`rl.tool_on_error`).
  """

  prompts: list[list[int]]
  tokens: np.ndarray
  logprobs: np.ndarray
  lengths: np.ndarray
  finish_reasons: list[str]
  num_truncated_prompts: int
  num_samples: int
  pad_id: int = _PAD_ID
  sampled: np.ndarray | None = None
  tool_calls: np.ndarray | None = None
  tool_errors: np.ndarray | None = None

  def completions(self) -> list[list[int]]:
    """The completion tokens per row, without padding."""
    return [self.tokens[i, : self.lengths[i]].tolist() for i in range(len(self.lengths))]


@dataclasses.dataclass
class PendingRollouts:
  """A dispatched decode program (`Sampler.start`): its device outputs, and what `result` needs to make `Rollouts`."""

  outputs: tuple[jax.Array, jax.Array, jax.Array]  # tokens, log-probs, lengths of the padded batch
  # The prompts' tokens [batch, bucket] (right-padded) and lengths as prefilled: global arrays when process_local.
  inputs: tuple[jax.Array | np.ndarray, jax.Array | np.ndarray]
  prompts: list[list[int]]
  num_samples: int
  num_truncated_prompts: int
  stops: set[int]
  process_local: bool

  def result(self) -> Rollouts:
    """Waits for the program and returns its rows (this process's own when `process_local`)."""
    if self.process_local:
      out, out_logprobs, out_lengths = (pipeline.local_rows(x) for x in self.outputs)
    else:  # gathered rather than fetched: on a multi-host mesh no process holds the whole batch
      out, out_logprobs, out_lengths = multihost_utils.process_allgather(self.outputs, tiled=True)
    rows = len(self.prompts) * self.num_samples
    out, out_logprobs, out_lengths = out[:rows], out_logprobs[:rows], out_lengths[:rows]
    return Rollouts(
        prompts=[prompt for prompt in self.prompts for _ in range(self.num_samples)],
        tokens=out,
        logprobs=out_logprobs,
        lengths=out_lengths,
        finish_reasons=["eos" if out[i, out_lengths[i] - 1] in self.stops else "length" for i in range(rows)],
        num_truncated_prompts=self.num_truncated_prompts,
        num_samples=self.num_samples,
    )


class Sampler:
  """Sampling B prompts x N samples with a MaxText model and MaxText's KV cache, with per-token log-probs.

  Construct once per (config, rollout mesh) and call `sample` (or `generate` for plain greedy continuations) with
  the policy's current params each time a rollout is needed. Each distinct bucket builds its decode graphs and
  compiles once; later calls in the same bucket reuse the program (`num_compiles` counts the traces). `lower` gives
  a bucket's program without running anything, for ahead-of-time compilation on a device topology.

  Only ids the config's tokenizer decodes are sampled: a `vocab_size` padded past the tokenizer's pieces leaves
  logits for ids that would fail decoding, and those are masked out (`logprobs.mask_undecodable`).
  """

  def __init__(self, config: pyconfig.HyperParameters, mesh: jax.sharding.Mesh):
    self.config = config
    self.mesh = mesh
    self.prefill_length = config.max_prefill_predict_length
    self.batch_multiple = _batch_multiple(config, mesh)
    self.num_compiles = 0
    self.num_pieces = pipeline.Encoder.from_config(config).num_pieces
    _, abstract_model = model_creation_utils.create_nnx_abstract_model(config, mesh)
    self.abstract_params = nnx.state(abstract_model, nnx.Param)  # the params `sample` takes, shaped and sharded
    self._programs: dict[tuple, tuple[_DecodeGraphs, Callable]] = {}
    self._resharding_logged = False

  def generate(self, params: nnx.State, prompts: list[list[int]], max_new_tokens: int, eos_id: int) -> list[list[int]]:
    """Greedily continues each prompt; returns the new tokens per prompt, ending with `eos_id` when it was produced.

    Args:
      params: the policy's weights, `nnx.state(model, nnx.Param)` of the trainer's model.
      prompts: token ids per prompt, each 1..max_prefill_predict_length long (longer ones are an error).
      max_new_tokens: tokens to generate at most per prompt (MaxText decodes max_target_length -
        max_prefill_predict_length).
      eos_id: generation of a sequence stops after this token, which is included in its output.
    """
    rollouts = self.sample(
        params, prompts, max_new_tokens, eos_id, jax.random.key(0), SamplingParams(), truncate_prompts=False
    )
    return rollouts.completions()

  def sample(self, *args, **kwargs) -> Rollouts:
    """`start(...).result()`: samples and waits for the rows; arguments as `start`'s."""
    return self.start(*args, **kwargs).result()

  def start(
      self,
      params: nnx.State,
      prompts: list[list[int]],
      max_new_tokens: int,
      eos_id: int,
      rng: jax.Array,
      sampling: SamplingParams | None = None,
      num_samples: int = 1,
      stop_ids: tuple[int, ...] = (),
      truncate_prompts: bool | None = None,
      process_local: bool = False,
      copy_params: bool = False,
      active: list[bool] | None = None,
  ) -> "PendingRollouts":
    """Dispatches the sampling of `num_samples` completions of each prompt (each prompt prefilled once) and returns
    as soon as the decode program runs on the sampler's devices; `PendingRollouts.result()` waits for the rows.

    Args:
      params: the policy's weights, `nnx.state(model, nnx.Param)` of a model built from this config; used in place
        when they live on this sampler's mesh, resharded onto it otherwise.
      prompts: token ids per prompt, at least one each.
      max_new_tokens: tokens to generate at most per sample.
      eos_id: a sample stops after this token (included, and scored).
      rng: a PRNG key; row r's token at step t is drawn with fold_in(fold_in(rng, r), t), so pass a new key per call
        (e.g. fold in the RL step).
      sampling: strategy, temperature, top-k, top-p; `SamplingParams.from_config(config)` when None.
      num_samples: samples per prompt (N).
      stop_ids: more tokens that stop a sample like `eos_id`.
      truncate_prompts: prompts longer than max_prefill_predict_length lose their left end (counted in the result)
        when true and are an error when false; None follows `overlong_policy`.
      process_local: false: every process passes the same prompts and gets every row back. True: each process
        passes its own prompts (the same number on every process), which take its block of the batch's rows
        (`pipeline.process_rows`), and gets back only its rows; row keys are global row numbers, so N processes
        sample what one process sampling all their prompts in process order would.
      copy_params: read a copy of `params` made before returning, so the caller may update or donate its own (a
        train step) while this program still runs.
      active: per prompt, whether to sample it (all when None); an inactive prompt's rows are done from the start
        (each still returns one drawn token: ignore it), and only its first token is prefilled.
    """
    sampling = sampling or SamplingParams.from_config(self.config)
    if truncate_prompts is None:
      truncate_prompts = self.config.overlong_policy == "truncate"
    prompts, num_truncated = self._truncate(prompts, truncate_prompts)
    inputs = self._process_local_inputs(prompts, active) if process_local else self._inputs(prompts, active)
    tokens = inputs[0]
    _, decode = self._program(tokens.shape[0], tokens.shape[1], num_samples, max_new_tokens, sampling)
    params = self.on_mesh(params, copy_params)
    stops = np.array(sorted({eos_id, *stop_ids}), np.int32)
    # Uncommitted, so the program places it on this mesh whatever device the caller's key was made on (a key made
    # under the trainer's mesh sits on the trainer's devices; a multi-process mesh takes no device_put of it).
    rng = jax.random.wrap_key_data(np.asarray(jax.random.key_data(rng)), impl=jax.random.key_impl(rng))
    with jax.set_mesh(self.mesh), nn_partitioning.axis_rules(self.config.logical_axis_rules):
      out = decode(params, *inputs, stops, rng)
    return PendingRollouts(out, inputs[:2], prompts, num_samples, num_truncated, set(stops.tolist()), process_local)

  def lower(
      self,
      batch: int,
      prompt_length: int,
      num_samples: int,
      max_new_tokens: int,
      sampling: SamplingParams | None = None,
  ) -> jax.stages.Lowered:
    """The decode program `sample` runs for `batch` prompts of up to `prompt_length` tokens, lowered abstractly.

    Nothing runs, so the mesh may be a topology without devices (MaxText's `train_compile.get_topology_mesh`): the
    result's `.compile().memory_analysis()` tells on a CPU host whether a rollout fits a TPU slice before a run.
    Batch padding and prompt bucket are `sample`'s; the program is the one a request with one stop id (EOS) runs.
    """
    sampling = sampling or SamplingParams.from_config(self.config)
    batch, bucket = self._shape(batch, prompt_length)
    _, decode = self._program(batch, bucket, num_samples, max_new_tokens, sampling)
    replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)
    key_dtype = jax.eval_shape(lambda: jax.random.key(0)).dtype
    with jax.set_mesh(self.mesh), nn_partitioning.axis_rules(self.config.logical_axis_rules):
      return decode.lower(
          self.abstract_params,
          spec((batch, bucket), jnp.int32),
          spec((batch,), jnp.int32),
          spec((batch,), jnp.bool_),
          spec((1,), jnp.int32),
          spec((), key_dtype),
      )

  def abstract_arrays(
      self, batch: int, prompt_length: int, num_samples: int, max_new_tokens: int
  ) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The arrays a request like `lower`'s leaves in its `PendingRollouts`, shaped and sharded: the prompts' tokens
    and lengths (`inputs`), then the completions' tokens and lengths (`outputs`); what scores rollouts where they
    were sampled reads (`rl.reference_devices=sampler`)."""
    batch, bucket = self._shape(batch, prompt_length)
    rows = batch * num_samples
    shapes = ((batch, bucket), (batch,), (rows, max_new_tokens), (rows,))
    return tuple(
        jax.ShapeDtypeStruct(s, jnp.int32, sharding=pipeline.batch_sharding(self.config, self.mesh, len(s)))
        for s in shapes
    )

  def on_mesh(self, params: nnx.State, copy: bool = False) -> nnx.State:
    """The params on this sampler's shardings: as they are when already there (unless `copy`), else one
    `jax.device_put`."""
    _check_params_line_up(params, self.abstract_params)
    targets = [a.sharding for a in jax.tree.leaves(self.abstract_params)]
    if not copy and all(getattr(x, "sharding", None) == t for x, t in zip(jax.tree.leaves(params), targets)):
      return params
    if not copy and not self._resharding_logged:
      max_logging.log("The policy params are not on the rollout mesh's shardings; resharding them for sampling.")
      self._resharding_logged = True
    return jax.tree.map(
        lambda x, a: jax.device_put(x, a.sharding, may_alias=False if copy else None), params, self.abstract_params
    )

  def _truncate(self, prompts: list[list[int]], truncate: bool) -> tuple[list[list[int]], int]:
    """Keeps the last max_prefill_predict_length tokens of longer prompts (or fails); counts the truncated ones."""
    out, num_truncated = [], 0
    for i, prompt in enumerate(prompts):
      if not prompt:
        raise ValueError(f"Prompt {i} is empty; decoding needs at least one prompt token.")
      if len(prompt) > self.prefill_length:
        if not truncate:
          raise ValueError(
              f"Prompt {i} has {len(prompt)} tokens, more than max_prefill_predict_length={self.prefill_length}."
          )
        prompt, num_truncated = prompt[-self.prefill_length :], num_truncated + 1
      out.append(list(prompt))
    if num_truncated:
      max_logging.log(f"{num_truncated} prompts were longer than {self.prefill_length} tokens; kept their right end.")
    return out, num_truncated

  def _shape(self, num_prompts: int, longest: int) -> tuple[int, int]:
    """(batch, prompt bucket) of a request: the batch padded to a multiple of its sharding, the bucket the next power
    of two of the longest prompt, capped at max_prefill_predict_length, so short prompts get a short prefill and a
    short cache."""
    bucket = min(self.prefill_length, max(_MIN_PROMPT_BUCKET, 1 << (longest - 1).bit_length()))
    return -(-num_prompts // self.batch_multiple) * self.batch_multiple, bucket

  def _inputs(self, prompts: list[list[int]], active: list[bool] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, lengths, active) of the whole batch: prompts right-padded to their bucket, the batch padded to a
    multiple of its sharding with inactive 1-token rows."""
    batch, bucket = self._shape(len(prompts), _longest(prompts, active))
    return _pad(prompts, batch, bucket, active)

  def _process_local_inputs(
      self, prompts: list[list[int]], active: list[bool] | None
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(tokens, lengths, active) as global arrays on the batch sharding, this process's prompts in its block of
    rows; the bucket is the longest prompt of any process, so all run the same program."""
    counts_and_longest = multihost_utils.process_allgather(np.array([len(prompts), _longest(prompts, active)], np.int32))
    counts_and_longest = np.asarray(counts_and_longest).reshape(-1, 2)
    if len(set(counts_and_longest[:, 0].tolist())) > 1:
      raise ValueError(f"process_local sampling needs as many prompts on every process, got {counts_and_longest[:, 0]}.")
    num_processes = jax.process_count()
    _, bucket = self._shape(len(prompts), int(counts_and_longest[:, 1].max()))
    multiple = math.lcm(self.batch_multiple, num_processes)
    batch = -(-len(prompts) * num_processes // multiple) * multiple
    local = _pad(prompts, batch // num_processes, bucket, active)
    return tuple(
        jax.make_array_from_process_local_data(
            pipeline.batch_sharding(self.config, self.mesh, x.ndim), x, (batch, *x.shape[1:])
        )
        for x in local
    )

  def _program(
      self, batch: int, prefill_length: int, num_samples: int, max_new_tokens: int, sampling: SamplingParams
  ) -> tuple[_DecodeGraphs, Callable]:
    """Builds (once) the prefill and autoregressive graphs and the jitted program for this bucket."""
    if num_samples < 1:
      raise ValueError(f"num_samples must be at least 1, got {num_samples}.")
    if max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}.")
    key = (batch, prefill_length, num_samples, max_new_tokens, sampling)
    if key not in self._programs:
      max_logging.log(
          f"Building the decode program for batch={batch} x {num_samples} samples, prompt bucket={prefill_length}, "
          f"max_new_tokens={max_new_tokens}, {sampling}."
      )
      build = functools.partial(self._graphs, batch, prefill_length, num_samples, max_new_tokens, sampling)
      graphs = build(unscan=self.config.scan_layers)
      if graphs.unscan and not _maps_onto(self.abstract_params, graphs.abstract_params):
        max_logging.log("The scanned params do not map onto the unscanned decode model; decoding with scanned layers.")
        graphs = build(unscan=False)
      self._programs[key] = (graphs, jax.jit(functools.partial(self._decode, graphs)))
    return self._programs[key]

  def _graphs(
      self,
      batch: int,
      prefill_length: int,
      num_samples: int,
      max_new_tokens: int,
      sampling: SamplingParams,
      unscan: bool,
  ) -> _DecodeGraphs:
    """Builds the prefill (B rows) and autoregressive (B x N rows) graphs abstractly; runs nothing."""
    scan_layers = self.config.scan_layers and not unscan
    platform = self.mesh.devices.flat[0].platform
    config = _decode_config(self.config, batch, prefill_length, max_new_tokens, scan_layers, platform)
    config_n = _decode_config(self.config, batch * num_samples, prefill_length, max_new_tokens, scan_layers, platform)
    _, prefill_model = model_creation_utils.create_nnx_abstract_model(config, self.mesh, model_mode=MODEL_MODE_PREFILL)
    _, prefill_cache_model = model_creation_utils.create_nnx_abstract_model(
        config, self.mesh, model_mode=MODEL_MODE_AUTOREGRESSIVE
    )
    create_ar_model, ar_model = model_creation_utils.create_nnx_abstract_model(
        config_n, self.mesh, model_mode=MODEL_MODE_AUTOREGRESSIVE
    )
    prefill_graph, _, _, _ = nnx.split(prefill_model, nnx.Param, nnx.Cache, ...)
    _, _, abstract_prefill_cache, _ = nnx.split(prefill_cache_model, nnx.Param, nnx.Cache, ...)
    ar_graph, abstract_params, abstract_cache, _ = nnx.split(ar_model, nnx.Param, nnx.Cache, ...)
    return _DecodeGraphs(
        num_samples,
        max_new_tokens,
        sampling,
        prefill_graph,
        ar_graph,
        abstract_params,
        unscan,
        abstract_prefill_cache,
        abstract_cache,
        create_ar_model,
    )

  def _decode(self, graphs: _DecodeGraphs, params, tokens, lengths, active, stops, rng):
    """Prefill + sampling loop; returns (tokens, log-probs [rows, max_new_tokens], lengths [rows]) for B x N rows.

    Rows of prompts that are batch padding (`active` false) count as finished from the start, so they never hold
    the loop open.
    """
    self.num_compiles += 1
    if graphs.unscan:
      params = _unscan(params, graphs.abstract_params)
    batch, prefill_length = tokens.shape
    num_samples, max_new_tokens, sampling = graphs.num_samples, graphs.max_new_tokens, graphs.sampling
    rows = batch * num_samples
    zeros = lambda a: jax.lax.with_sharding_constraint(jnp.zeros(a.shape, a.dtype), a.sharding)
    rest = nnx.split(graphs.create_model(), nnx.Param, nnx.Cache, ...)[3]

    positions = jnp.broadcast_to(jnp.arange(prefill_length, dtype=jnp.int32), (batch, prefill_length))
    segment_ids = (positions < lengths[:, None]).astype(jnp.int32) * DECODING_ACTIVE_SEQUENCE_INDICATOR
    prefill_cache = jax.tree.map(zeros, graphs.abstract_prefill_cache)
    model = nnx.merge(graphs.prefill_graph, params, prefill_cache, rest, copy=True)
    logits = model(
        tokens, positions, decoder_segment_ids=segment_ids, enable_dropout=False, model_mode=MODEL_MODE_PREFILL
    )
    # Each prompt's cache, repeated to its N sample rows (the batch axis is the one whose size differs). Matched
    # leaf by leaf: a scanned prefill model's cache carries other sharding metadata than the decode model's.
    cache, treedef = jax.tree.flatten(nnx.state(model, nnx.Cache))
    cache = [
        jax.lax.with_sharding_constraint(_repeat_rows(x, a.shape, num_samples), a.sharding)
        for x, a in zip(cache, jax.tree.leaves(graphs.abstract_cache), strict=True)
    ]
    cache = jax.tree.unflatten(treedef, cache)
    lengths = jnp.repeat(lengths, num_samples)
    last_logits = jnp.take_along_axis(logits, (lengths[::num_samples] - 1)[:, None, None], axis=1)[:, 0]
    last_logits = jnp.repeat(last_logits, num_samples, axis=0)
    row_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rng, jnp.arange(rows))

    def draw(logits, step):
      logits = logprobs_lib.mask_undecodable(logits, self.num_pieces)
      token = sampling.draw(logits, jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, step))
      return token, logprobs_lib.token_logprobs(logits, token, sampling.temperature)

    first, first_logprob = draw(last_logits, 0)
    out = jnp.full((rows, max_new_tokens), _PAD_ID, jnp.int32).at[:, 0].set(first)
    out_logprobs = jnp.zeros((rows, max_new_tokens), jnp.float32).at[:, 0].set(first_logprob)
    done = ~jnp.repeat(active, num_samples) | jnp.isin(first, stops)
    carry = (jnp.int32(1), cache, out, out_logprobs, done, jnp.ones((rows,), jnp.int32))

    def cond(carry):
      step, _, _, _, done, _ = carry
      return (step < max_new_tokens) & ~jnp.all(done)

    def body(carry):
      step, cache, out, out_logprobs, done, num = carry
      previous = jax.lax.dynamic_slice_in_dim(out, step - 1, 1, axis=1)
      model = nnx.merge(graphs.autoregressive_graph, params, cache, rest, copy=True)
      logits = model(previous, (lengths + step - 1)[:, None], enable_dropout=False, model_mode=MODEL_MODE_AUTOREGRESSIVE)
      token, logprob = draw(logits[:, 0], step)
      token, logprob = jnp.where(done, _PAD_ID, token), jnp.where(done, 0.0, logprob)
      out = jax.lax.dynamic_update_slice_in_dim(out, token[:, None], step, axis=1)
      out_logprobs = jax.lax.dynamic_update_slice_in_dim(out_logprobs, logprob[:, None], step, axis=1)
      num = num + (~done).astype(jnp.int32)
      return step + 1, nnx.state(model, nnx.Cache), out, out_logprobs, done | jnp.isin(token, stops), num

    _, _, out, out_logprobs, _, num = jax.lax.while_loop(cond, body, carry)
    # Rows stay on the batch sharding, so each process holds the rows of its own prompts.
    return tuple(
        jax.lax.with_sharding_constraint(x, pipeline.batch_sharding(self.config, self.mesh, x.ndim))
        for x in (out, out_logprobs, num)
    )


def _longest(prompts: list[list[int]], active: list[bool] | None) -> int:
  """The longest prompt's length, of the active ones (`_pad` keeps one token of the others)."""
  return max(len(p) if active is None or active[i] else 1 for i, p in enumerate(prompts))


def _pad(
    prompts: list[list[int]], batch: int, bucket: int, active: list[bool] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(tokens [batch, bucket], lengths [batch], active [batch]): prompts right-padded to the bucket, then inactive
  1-token rows up to `batch`; an inactive prompt (`active`) keeps one token."""
  tokens = np.full((batch, bucket), _PAD_ID, dtype=np.int32)
  lengths = np.ones((batch,), dtype=np.int32)
  flags = np.arange(batch) < len(prompts)
  for i, prompt in enumerate(prompts):
    if active is not None and not active[i]:
      prompt, flags[i] = prompt[:1], False
    tokens[i, : len(prompt)] = prompt
    lengths[i] = len(prompt)
  return tokens, lengths, flags


def _repeat_rows(x: jax.Array, shape: tuple[int, ...], num_samples: int) -> jax.Array:
  """`x` with its batch axis (the one axis where it differs from `shape`) repeated `num_samples` times per row."""
  if x.shape == tuple(shape):
    return x
  (axis,) = [i for i, (have, want) in enumerate(zip(x.shape, shape)) if have != want]
  return jnp.repeat(x, num_samples, axis=axis)

"""Decoding with MaxText's own decode path: one batched prefill, then an on-device autoregressive loop over the KV cache.

This is the path MaxEngine takes (prefill-mode model call, then autoregressive-mode calls reading and extending
MaxText's `KVCache`), without MaxEngine itself: MaxEngine needs JetStream, prefills one prompt at a time and
round-trips to the host for every token. Here a whole batch of ragged prompts is prefilled in one call (right
padding, masked by segment ids exactly as MaxText masks packed or padded prefill) and the token loop is a
`jax.lax.while_loop` inside one jitted program that stops as soon as every sequence has produced EOS.

Sizes are static per (batch, max_new_tokens) bucket: the prompt is padded to `max_prefill_predict_length`, the
prefill part of the cache has that length and the autoregressive part `max_new_tokens` (not `max_target_length`),
and the decode graphs and program are built and compiled once per bucket and reused.

The policy's weights are read in place: `generate` takes the trainer's `nnx.State` of `nnx.Param` as a jit
argument, so on a shared mesh there is no host round trip; `generate` checks the tree is the one this config builds.
The decode graphs are built from the same config, with one change when the trainer scans its layers: decoding runs
an unscanned graph and the stacked weights are sliced per layer once per call inside the program (`_unscan`), because
a scan inside the token loop re-slices every layer's weights on every token. Where the slices do not map onto the
unscanned model (an unusual layer stack), the decode graph stays scanned and takes the params as they are.
"""

from collections.abc import Callable
import dataclasses
import functools

from flax import nnx
from flax import linen as nn
from flax.linen import partitioning as nn_partitioning
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np

from maxtext.common.common_types import DECODING_ACTIVE_SEQUENCE_INDICATOR, MODEL_MODE_AUTOREGRESSIVE, MODEL_MODE_PREFILL
from maxtext.configs import pyconfig
from maxtext.utils import max_logging
from maxtext.utils import model_creation_utils

# Fills the prompt tail and the positions after EOS; never attended to (segment id 0) nor returned.
_PAD_ID = 0


@dataclasses.dataclass(frozen=True)
class _DecodeGraphs:
  """What the decode program of one (batch, max_new_tokens) shape is traced from."""

  max_new_tokens: int
  prefill_graph: nnx.GraphDef
  autoregressive_graph: nnx.GraphDef
  abstract_params: nnx.State  # ShapeDtypeStructs of the decode model's params (unscanned when `unscan`)
  unscan: bool  # the policy's scanned params are split per layer inside the program (see `_unscan`)
  abstract_cache: nnx.State  # ShapeDtypeStructs (with shardings) of the zero cache the program starts from
  rest: nnx.State  # the model's remaining state (RNG streams), concrete because nnx.merge needs values


def _decode_config(
    config: pyconfig.HyperParameters, batch: int, max_new_tokens: int, scan_layers: bool
) -> pyconfig.HyperParameters:
  """The training config with the cache sized for one (batch, max_new_tokens) shape, layers scanned or not.

  MaxText sizes the autoregressive cache as `max_target_length - max_prefill_predict_length` and its batch as
  `micro_batch_size_to_train_on`, both read at model construction; nothing else in a model's weights depends on
  them for the decoder blocks this targets (the unscanned decode graph is only used when its params line up with
  the policy's). The copy skips validation on purpose, as MaxText's own `verify_and_sync_scan_layers` does for its
  config override.
  """
  update = {
      "max_target_length": config.max_prefill_predict_length + max_new_tokens,
      "micro_batch_size_to_train_on": batch,
      "scan_layers": scan_layers,
  }
  return pyconfig.HyperParameters(config._pydantic_config.model_copy(update=update))  # pylint: disable=protected-access


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


class Sampler:
  """Greedy decoding of a batch of prompts with a MaxText model and MaxText's KV cache.

  Construct once per (config, mesh) — the trainer's — and call `generate` with the policy's current params each time
  a rollout is needed. Each distinct (padded batch, max_new_tokens) pair builds its decode graphs and compiles once;
  later calls with the same pair reuse the program (`num_compiles` counts the traces).
  """

  def __init__(self, config: pyconfig.HyperParameters, mesh: jax.sharding.Mesh):
    self.config = config
    self.mesh = mesh
    self.prefill_length = config.max_prefill_predict_length
    self.batch_multiple = _batch_multiple(config, mesh)
    self.num_compiles = 0
    _, abstract_model = model_creation_utils.create_nnx_abstract_model(config, mesh)
    self._abstract_params = nnx.state(abstract_model, nnx.Param)
    self._programs: dict[tuple[int, int], tuple[_DecodeGraphs, Callable]] = {}

  def generate(self, params: nnx.State, prompts: list[list[int]], max_new_tokens: int, eos_id: int) -> list[list[int]]:
    """Greedily continues each prompt; returns the new tokens per prompt, ending with `eos_id` when it was produced.

    Args:
      params: the policy's weights, `nnx.state(model, nnx.Param)` of the trainer's model; used in place.
      prompts: token ids per prompt, each 1..max_prefill_predict_length long.
      max_new_tokens: tokens to generate at most per prompt (MaxText decodes max_target_length -
        max_prefill_predict_length).
      eos_id: generation of a sequence stops after this token, which is included in its output.
    """
    if max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}.")
    tokens, lengths = self._pad(prompts)
    graphs, decode = self._program(tokens.shape[0], max_new_tokens)
    _check_params_line_up(params, self._abstract_params)
    active = np.arange(tokens.shape[0]) < len(prompts)
    with jax.set_mesh(self.mesh), nn_partitioning.axis_rules(self.config.logical_axis_rules):
      out, out_lengths = decode(params, tokens, lengths, active, np.int32(eos_id))
    # Gathered rather than fetched: on a multi-host mesh no process holds the whole batch.
    out, out_lengths = multihost_utils.process_allgather((out, out_lengths), tiled=True)
    return [out[i, : out_lengths[i]].tolist() for i in range(len(prompts))]

  def _pad(self, prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads prompts to the prefill length and the batch to a multiple of its sharding (with 1-token rows)."""
    for i, prompt in enumerate(prompts):
      if not prompt:
        raise ValueError(f"Prompt {i} is empty; decoding needs at least one prompt token.")
      if len(prompt) > self.prefill_length:
        raise ValueError(
            f"Prompt {i} has {len(prompt)} tokens, more than max_prefill_predict_length={self.prefill_length}."
        )
    batch = -(-len(prompts) // self.batch_multiple) * self.batch_multiple
    tokens = np.full((batch, self.prefill_length), _PAD_ID, dtype=np.int32)
    lengths = np.ones((batch,), dtype=np.int32)
    for i, prompt in enumerate(prompts):
      tokens[i, : len(prompt)] = prompt
      lengths[i] = len(prompt)
    return tokens, lengths

  def _program(self, batch: int, max_new_tokens: int) -> tuple[_DecodeGraphs, Callable]:
    """Builds (once) the prefill and autoregressive graphs and the jitted program for this shape."""
    key = (batch, max_new_tokens)
    if key not in self._programs:
      max_logging.log(f"Building the decode program for batch={batch}, max_new_tokens={max_new_tokens}.")
      graphs = self._graphs(batch, max_new_tokens, unscan=self.config.scan_layers)
      if graphs.unscan and not _maps_onto(self._abstract_params, graphs.abstract_params):
        max_logging.log("The scanned params do not map onto the unscanned decode model; decoding with scanned layers.")
        graphs = self._graphs(batch, max_new_tokens, unscan=False)
      self._programs[key] = (graphs, jax.jit(functools.partial(self._decode, graphs)))
    return self._programs[key]

  def _graphs(self, batch: int, max_new_tokens: int, unscan: bool) -> _DecodeGraphs:
    """Builds the prefill and autoregressive graphs (abstractly) and the non-weight state for this shape."""
    config = _decode_config(self.config, batch, max_new_tokens, scan_layers=self.config.scan_layers and not unscan)
    _, prefill_model = model_creation_utils.create_nnx_abstract_model(config, self.mesh, model_mode=MODEL_MODE_PREFILL)
    create_ar_model, ar_model = model_creation_utils.create_nnx_abstract_model(
        config, self.mesh, model_mode=MODEL_MODE_AUTOREGRESSIVE
    )
    prefill_graph, _, _, _ = nnx.split(prefill_model, nnx.Param, nnx.Cache, ...)
    ar_graph, abstract_params, abstract_cache, _ = nnx.split(ar_model, nnx.Param, nnx.Cache, ...)
    # Materialise only the non-weight state; XLA drops the unused weight initialisers from this program.
    with jax.set_mesh(self.mesh), nn_partitioning.axis_rules(self.config.logical_axis_rules):
      rest = jax.jit(lambda: nnx.split(create_ar_model(), nnx.Param, nnx.Cache, ...)[3])()
    return _DecodeGraphs(max_new_tokens, prefill_graph, ar_graph, abstract_params, unscan, abstract_cache, rest)

  def _decode(self, graphs: _DecodeGraphs, params, tokens, lengths, active, eos_id):
    """Prefill + greedy autoregressive loop; returns (tokens [batch, max_new_tokens], generated lengths [batch]).

    Rows that are batch padding (`active` false) count as finished from the start, so they never hold the loop open.
    """
    self.num_compiles += 1
    if graphs.unscan:
      params = _unscan(params, graphs.abstract_params)
    batch, prefill_length = tokens.shape
    max_new_tokens = graphs.max_new_tokens
    cache = jax.tree.map(
        lambda a: jax.lax.with_sharding_constraint(jnp.zeros(a.shape, a.dtype), a.sharding), graphs.abstract_cache
    )

    positions = jnp.broadcast_to(jnp.arange(prefill_length, dtype=jnp.int32), (batch, prefill_length))
    segment_ids = (positions < lengths[:, None]).astype(jnp.int32) * DECODING_ACTIVE_SEQUENCE_INDICATOR
    model = nnx.merge(graphs.prefill_graph, params, cache, graphs.rest, copy=True)
    logits = model(
        tokens, positions, decoder_segment_ids=segment_ids, enable_dropout=False, model_mode=MODEL_MODE_PREFILL
    )
    cache = nnx.state(model, nnx.Cache)
    last_logits = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    first = _greedy(last_logits)

    out = jnp.full((batch, max_new_tokens), _PAD_ID, jnp.int32).at[:, 0].set(first)
    carry = (jnp.int32(1), cache, out, ~active | (first == eos_id), jnp.ones((batch,), jnp.int32))

    def cond(carry):
      step, _, _, done, _ = carry
      return (step < max_new_tokens) & ~jnp.all(done)

    def body(carry):
      step, cache, out, done, num = carry
      previous = jax.lax.dynamic_slice_in_dim(out, step - 1, 1, axis=1)
      model = nnx.merge(graphs.autoregressive_graph, params, cache, graphs.rest, copy=True)
      logits = model(previous, (lengths + step - 1)[:, None], enable_dropout=False, model_mode=MODEL_MODE_AUTOREGRESSIVE)
      token = jnp.where(done, _PAD_ID, _greedy(logits[:, 0]))
      out = jax.lax.dynamic_update_slice_in_dim(out, token[:, None], step, axis=1)
      num = num + (~done).astype(jnp.int32)
      return step + 1, nnx.state(model, nnx.Cache), out, done | (token == eos_id), num

    _, _, out, _, num = jax.lax.while_loop(cond, body, carry)
    return out, num


def _greedy(logits: jax.Array) -> jax.Array:
  """The next token per row: argmax of the last-axis logits."""
  return jnp.argmax(logits, axis=-1).astype(jnp.int32)

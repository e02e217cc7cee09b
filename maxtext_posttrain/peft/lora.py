"""LoRA and QLoRA as a switch on any objective: MaxText's qwix wiring, with its inputs checked up front.

MaxText already turns the `lora.*` keys into a qwix `LoraProvider` (`lora_utils._build_lora_provider`), saves and
restores only the adapter state when `lora.enable_lora` is set (`checkpointing._filter_lora_trainable_state`) and
builds its optimizer over `nnx.LoRAParam`. A trained role's model initialiser calls `apply`, and its start
(`prepare_start`, `finish_start`) reads what LoRA needs, so every objective (SFT, DPO, RL, distillation) and every
trained role in `lora_roles` gets adapters without knowing about them.
What this module adds is what MaxText leaves to a failed trace or a silent no-op: a target regex that matches no
module, a rank that is not below the layer width, an alpha that scales the adapters to zero, adapters that compute
in `dtype` as MaxText's kernels do (qwix's own promote a bfloat16 layer to their float32 `weight_dtype`, which fails
the scanned decoder's trace), and the merge of trained adapters back into full weights (`merged_params`), which
`export` writes as a MaxText checkpoint. It also gives `lora.lora_restore_path` a checked meaning across the loop,
the reference role and the decode commands: MaxText's own restore matches stored adapters by path and skips what it
does not find, so adapters of other target modules would load partly or not at all without an error.
"""

from collections.abc import Callable
import re

import jax
import jax.numpy as jnp
from etils import epath
from flax import nnx
from flax.linen import partitioning as nn_partitioning
import qwix
from qwix._src.core import qarray
from qwix._src.providers import lora as qwix_lora
from qwix._src.providers import ptq
from qwix._src.utils import flax_util

from maxtext.common import checkpointing
from maxtext.configs import pyconfig
from maxtext.utils import model_creation_utils
from maxtext.utils import lora_utils
from maxtext.utils import max_logging

from maxtext_posttrain import checkpoint_guard
from maxtext_posttrain import config as config_lib
from maxtext_posttrain import forward
from maxtext_posttrain import layer_transfer

_LISTED = 8
# Trained roles that may carry adapters; frozen roles (reference, reward model, teacher) never do.
TRAINED_ROLES = ("policy", "critic", "reward_model")


def enabled(config, role: str = "policy") -> bool:
  return config.lora.enable_lora and role in config.lora_roles


def module_path_regex(config) -> str:
  """`lora.lora_module_path`, or MaxText's per-architecture default (attention q/k/v/out and MLP wi/wo)."""
  return lora_utils._get_lora_module_path(config)  # pylint: disable=protected-access


def validate_config(config) -> None:
  """Raises ConfigError for `lora.*` settings that would train nothing or that the loop cannot honour."""
  lora = config.lora
  if lora.lora_restore_path and not enabled(config):
    raise config_lib.ConfigError(
        f"lora.lora_restore_path={lora.lora_restore_path} is set but the policy carries no adapters "
        f"(lora.enable_lora={lora.enable_lora}, lora_roles={list(config.lora_roles)})."
    )
  if not lora.enable_lora:
    return
  if config.lora_input_adapters_path:
    raise config_lib.ConfigError(
        f"lora_input_adapters_path={config.lora_input_adapters_path} is MaxText's loader of serving adapters, under "
        "which no adapters would train. Start from stored adapters with lora.lora_restore_path."
    )
  unknown = sorted(set(config.lora_roles) - set(TRAINED_ROLES))
  if unknown:
    raise config_lib.ConfigError(
        f"lora_roles {unknown}: adapters apply to trained roles only, one of {list(TRAINED_ROLES)}."
    )
  if lora.lora_rank <= 0:
    raise config_lib.ConfigError(f"lora.lora_rank must be > 0 when lora.enable_lora=true (got {lora.lora_rank}).")
  if lora.lora_alpha <= 0:
    raise config_lib.ConfigError(
        f"lora.lora_alpha must be > 0 (got {lora.lora_alpha}): adapter outputs are scaled by alpha / rank, so 0 "
        "trains nothing. A common choice is lora_alpha = 2 * lora_rank."
    )


def check_restore_source(adapters: nnx.State, config) -> None:
  """Raises ValueError unless `lora.lora_restore_path` holds adapters this config's model can take: the path
  exists, the rank and alpha in the `lora` metadata MaxText's checkpoint save records are this config's (alpha
  leaves no trace in the shapes), and the stored adapters cover exactly the modules and shapes of `adapters` (the
  model's `nnx.LoRAParam` state, concrete or abstract). Cheap: it reads metadata only."""
  path = config.lora.lora_restore_path
  if not epath.Path(path).exists():
    raise ValueError(f"lora.lora_restore_path={path} does not exist.")
  stored = checkpointing.load_checkpoint_metadata(path).get("lora")
  if not stored:
    max_logging.log(f"lora.lora_restore_path={path} records no lora metadata: rank and alpha are not checked.")
    stored = {}
  differ = [
      f"{key}={stored[key]} there, {getattr(config.lora, key)} here"
      for key in ("lora_rank", "lora_alpha")
      if key in stored and stored[key] != getattr(config.lora, key)
  ]
  if differ:
    raise ValueError(
        f"lora.lora_restore_path={path} holds adapters trained with other settings: {'; '.join(differ)}. "
        "Set lora.lora_rank and lora.lora_alpha to the adapters' values."
    )
  checkpoint_guard.check_adapter_source(path, adapters)


def _module_paths(model: nnx.Module) -> list[str]:
  return ["/".join(str(p) for p in path) for path, _ in nnx.iter_modules(model) if path]


class _ComputeDtypeLoraProvider(qwix.LoraProvider):
  """qwix's LoRA under MaxText's mixed precision: weights stored in `weight_dtype`, computed in `dtype`.

  qwix adds alpha/rank * (x A) B to the layer's result in the adapters' dtype, that of the frozen weight
  (`weight_dtype`). MaxText's layers cast their kernels to `dtype`, so under `dtype=bfloat16 weight_dtype=float32`
  the sum promoted a bfloat16 layer output to float32 and the scanned decoder's carry changed dtype. Here the
  adapters get a kernel's treatment: stored, differentiated and updated in `weight_dtype` (`_apply_adapters`), cast
  to the activations' dtype for the product; the delta takes the base result's dtype, so a layer returns the dtype
  it returns without adapters. The base matmul is qwix's (its PTQ one under QLoRA); only the adapter branch is
  rewritten, and without dropout, which MaxText's rule always sets to 0.
  """

  def _target(self, op_name: str, rhs) -> tuple[qwix.LoraRule, str] | None:
    """The LoraRule and frozen weight this op adds adapters to, found as qwix does; None for other ops."""
    rule, _ = self._get_current_rule_and_op_id(op_name, repeated_call=True)
    name = flax_util.find_param(rhs, ptq.WithAux)
    return (rule, name) if isinstance(rule, qwix.LoraRule) and name is not None else None

  def dot_general(
      self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None
  ) -> jax.Array:
    res = ptq.PtqProvider.dot_general(
        self, lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding=out_sharding
    )
    target = self._target("dot_general", rhs)
    if target is None:
      return res
    rule, name = target
    (lhs_ca, rhs_ca), (lhs_ba, rhs_ba) = dimension_numbers
    rhs_ra = tuple(i for i in range(rhs.ndim) if i not in rhs_ca and i not in rhs_ba)
    shapes = [tuple(rhs.shape[i] for i in axes) for axes in (rhs_ca, rhs_ba, rhs_ra)]
    # pylint: disable=protected-access
    a_shape, a_transpose, b_shape, b_transpose = qwix_lora._create_lora_layer_shapes(
        rhs_ca, rhs_ba, rhs_ra, *shapes, rule.rank
    )
    a, b = _adapters_in(lhs.dtype, name, rule, a_shape, b_shape, a_transpose, b_transpose)
    delta = qwix_lora._compute_lora_delta(lhs, a, b, lhs_ca, lhs_ba, *shapes, rule.rank, precision=precision)
    return res + (delta * (rule.alpha / rule.rank)).astype(res.dtype)

  def einsum(self, einsum_str, *operands, **kwargs) -> jax.Array:
    res = ptq.PtqProvider.einsum(self, einsum_str, *operands, **kwargs)
    target = self._target("einsum", operands[-1])
    if target is None:
      return res
    rule, name = target
    lhs, rhs = operands  # qwix's LoRA takes binary einsums only
    # pylint: disable=protected-access
    a_shape, b_shape, lora_str, a_transpose, b_transpose = qwix_lora._parse_einsum_str_for_lora(
        lhs.shape, rhs.shape, einsum_str, rule.rank
    )
    a, b = _adapters_in(lhs.dtype, name, rule, a_shape, b_shape, a_transpose, b_transpose)
    delta = jnp.einsum(lora_str, lhs, a, b, **kwargs)
    return res + (delta * (rule.alpha / rule.rank)).astype(res.dtype)


def _adapters_in(dtype, name, rule, a_shape, b_shape, a_transpose, b_transpose) -> tuple[jax.Array, jax.Array]:
  """The adapters of the current module's weight `name` (created on qwix's first trace), cast to `dtype`."""
  a, b = qwix_lora._get_or_create_lora_params(  # pylint: disable=protected-access
      name=name,
      rule=rule,
      a_shape=a_shape,
      b_shape=b_shape,
      a_sharding_transpose=a_transpose,
      b_sharding_transpose=b_transpose,
  )
  return a.astype(dtype), b.astype(dtype)


def _apply_adapters(model: nnx.Module, config) -> nnx.Module:
  """What MaxText's `lora_utils.apply_lora_to_model` does, from its own helpers, but with the provider's LoRA
  branch computing in `dtype` (`_ComputeDtypeLoraProvider`): that function builds and uses its provider in one call.
  Without a mesh: MaxText would reshard concrete adapter arrays, which fails under the loop's jit/eval_shape; the
  adapters are replicated through their (PartitionSpec()) metadata and the state's out_shardings instead."""
  # pylint: disable=protected-access
  provider = lora_utils._build_lora_provider(config)
  # Retyped, as qwix retypes the models it wraps: the rules stay the ones MaxText built and qwix validated from the
  # `lora.*` keys (qwix refuses its own validated rules a second time).
  provider.__class__ = _ComputeDtypeLoraProvider
  tokens, positions = lora_utils._prepare_dummy_inputs()
  rngs = getattr(getattr(model, "decoder", model), "rngs", None)
  model = qwix.apply_lora_to_model(model, provider, decoder_input_tokens=tokens, decoder_positions=positions, rngs=rngs)
  nnx.pop(model, nnx.Intermediate)  # what qwix's call on the dummy inputs sowed (an MoE router's loss), not state
  for _, node in nnx.iter_graph(model):
    if "qwix_rngs" in getattr(node, "__dict__", {}):
      del node.qwix_rngs
    if isinstance(node, nnx.LoRAParam):
      # Stored in `weight_dtype` like every trained weight. qwix takes the frozen weight's dtype, which under QLoRA is
      # its scale's: `dtype`, since qwix quantizes the kernel MaxText has cast to it.
      node.set_value(node.get_value().astype(config.weight_dtype))
      # MaxText sets sharding=PartitionSpec(), out_sharding=None, sharding_names=None; flax reads the first and last
      # as deprecated spellings of out_sharding, so the three come to out_sharding=None: replicated adapters.
      node.set_metadata(out_sharding=None)
  lora_utils._verify_lora_parameters(model, config)
  return model


def apply(model: nnx.Module, config, role: str = "policy") -> nnx.Module:
  """The model with qwix adapters (and, with `lora.lora_weight_qtype`, a quantized frozen base); unchanged when
  LoRA is off for this role. Raises ValueError naming real module paths when the target regex matches none, and
  when the rank is not below the narrower side of a targeted kernel."""
  if not enabled(config, role):
    return model
  pattern = module_path_regex(config)
  paths = _module_paths(model)
  if not any(re.fullmatch(pattern, p) for p in paths):
    with_kernels = ["/".join(str(p) for p in path) for path, m in nnx.iter_modules(model) if hasattr(m, "kernel")]
    raise ValueError(
        f"lora.lora_module_path={pattern!r} matches no module of this model (qwix full-matches module paths). "
        f"Modules with weights include: {with_kernels[:_LISTED]}"
    )
  model = _apply_adapters(model, config)
  rank = config.lora.lora_rank
  for path, module in nnx.iter_modules(model):
    for name in [n for n in vars(module) if n.endswith("_lora_a")]:
      a, b = getattr(module, name), getattr(module, name[: -len("_a")] + "_b")
      width = min(a.shape[0], b.shape[-1])  # (contracted in-features, rank) and (rank, out-features)
      if rank > width:
        where = "/".join(str(p) for p in path) + "/" + name[: -len("_lora_a")]
        raise ValueError(f"lora.lora_rank={rank} exceeds the width {width} of {where}; pick a rank below {width + 1}.")
  return model


def _value(x):
  return x.get_value() if isinstance(x, nnx.Variable) else x


def _dense_kernel(kernel) -> jax.Array:
  """A full-precision kernel: itself, or the dequantized base of QLoRA (a qwix `WithAux` over a `QArray`)."""
  kernel = _value(kernel)
  if isinstance(kernel, ptq.WithAux):
    array = jax.tree.map(_value, kernel.array, is_leaf=lambda v: isinstance(v, nnx.Variable))
    return qarray.dequantize(array)
  return kernel


def _delta(kernel_shape, a, b, scale, scan_axis) -> jax.Array:
  """alpha/rank * A @ B in the kernel's layout. qwix flattens a kernel's contracted (leading) axes into A's rows
  and its remaining axes into B's columns; scanned layers add one stacked axis at `param_scan_axis` to all three."""
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  if a.ndim == 2:
    return (a @ b).reshape(kernel_shape) * scale
  stacked = jnp.einsum("lcr,lrm->lcm", jnp.moveaxis(a, scan_axis, 0), jnp.moveaxis(b, scan_axis, 0)) * scale
  per_layer = kernel_shape[:scan_axis] + kernel_shape[scan_axis + 1 :]
  return jnp.moveaxis(stacked.reshape((stacked.shape[0], *per_layer)), 0, scan_axis)


def merged_params(model: nnx.Module, config) -> dict:
  """The weights of the same model without adapters, each targeted kernel replaced by W + alpha/rank * A @ B (W
  dequantized under QLoRA), as the pure dict MaxText's `load_parameters_path` reads."""
  scale = config.lora.lora_alpha / config.lora.lora_rank
  params = nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))).to_pure_dict()
  merged = 0
  for path, module in nnx.iter_modules(model):
    if not hasattr(module, "kernel_lora_a"):
      continue
    node = params
    for key in path:
      node = node[key]
    kernel = _dense_kernel(module.kernel)
    delta = _delta(
        kernel.shape, _value(module.kernel_lora_a), _value(module.kernel_lora_b), scale, config.param_scan_axis
    )
    dtype = jnp.dtype(config.weight_dtype)
    node["kernel"] = (kernel.astype(jnp.float32) + delta).astype(dtype)
    merged += 1
  max_logging.log(f"Merged the adapters of {merged} modules (scale alpha/rank = {scale}).")
  return params


# A full-weight model's weights that MaxText's decode graphs read: its params without distillation's feature map.
DECODED = nnx.All(nnx.Param, nnx.Not(layer_transfer.FeatureProjection))


def policy_params(model: nnx.Module, config) -> nnx.State:
  """The policy's weights as a model without adapters holds them, which is what MaxText's decode graphs (the
  rollout sampler, generation eval) read: `nnx.state(model, DECODED)`, or under (Q)LoRA the merged weights."""
  if not enabled(config):
    return nnx.state(model, DECODED)
  graphdef, state = nnx.split(model)
  return merge_program(graphdef, config)(state)


def merge_program(graphdef: nnx.GraphDef, config) -> Callable[[nnx.State], nnx.State]:
  """`policy_params` of a (Q)LoRA model of `graphdef`, compiled as one function of the model's state, for callers
  that merge at every rollout (RL): one dispatch per merge instead of one per operation on each adapted kernel."""

  def merge(state: nnx.State) -> nnx.State:
    model = nnx.merge(graphdef, state)
    # Each merged weight keeps its variable's metadata (sharding names, scan axis), which decoding relies on; a
    # QLoRA kernel takes that of its quantized codes, which have the kernel's shape and axes.
    variables = dict(nnx.to_flat_state(nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))))
    merged = nnx.traversals.flatten_mapping(merged_params(model, config))
    return nnx.from_flat_state(
        {
            path: variables.get(path, variables.get((*path, "array", "qvalue"))).replace(value)
            for path, value in merged.items()
        }
    )

  return jax.jit(merge)


def starting_adapters(adapters: nnx.State, config) -> nnx.State:
  """The adapters a run starts from, shaped and placed like `adapters` (a model's `nnx.LoRAParam` state): those
  stored at `lora.lora_restore_path` (an adapter checkpoint of an earlier run, `.../checkpoints/<step>[/items]`;
  its optimizer state is not read), or zeros, which make the model its base alone."""
  path = config.lora.lora_restore_path
  if not path:
    return jax.tree.map(lambda x: jnp.zeros_like(x, device=x.sharding), adapters)
  check_restore_source(adapters, config)
  return load_like(path, adapters, config)


def load_like(path: str, tree: nnx.State, config) -> nnx.State:
  """The weights of `tree`'s paths read from the checkpoint at `path` by MaxText's loader, with `tree`'s shapes,
  dtypes and shardings."""
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
  return checkpointing.load_params_from_path(
      path,
      abstract,
      config.checkpoint_storage_concurrent_gb,
      use_ocdbt=config.checkpoint_storage_use_ocdbt,
      use_zarr3=config.checkpoint_storage_use_zarr3,
  )


def _pretrained_with_adapters(config, mesh) -> nnx.Module:
  """MaxText's `from_pretrained` model with qwix adapters (and under QLoRA its base quantized), applied under the
  mesh and logical axis rules, since qwix traces the model once."""
  model = forward.with_lm_head(model_creation_utils.from_pretrained(config, mesh))
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
    return apply(model, config)


def pretrained_model(config, mesh) -> nnx.Module:
  """MaxText's `from_pretrained` model (`load_parameters_path`, or the seeded init), with the adapters of
  `lora.lora_restore_path` on it (over a qwix-quantized base under QLoRA) when that key is set: what the evaluate
  and sample commands decode and what a precomputing reference scores with."""
  validate_config(config)
  if not config.lora.lora_restore_path:
    return forward.with_lm_head(model_creation_utils.from_pretrained(config, mesh))
  model = _pretrained_with_adapters(config, mesh)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())  # as a training state's adapters are
  nnx.update(model, starting_adapters(jax.device_put(nnx.state(model, nnx.LoRAParam), replicated), config))
  return model


def restore_adapters(state: nnx.State, config) -> nnx.State:
  """`state` (a fresh run's, step 0) with its adapters read from `lora.lora_restore_path`: training continues from
  adapters an earlier run trained (SFT adapters into DPO or RL, say) with a fresh optimizer and schedule."""
  adapters = starting_adapters(state.model.filter(nnx.LoRAParam), config)
  max_logging.log(f"Adapters restored from lora.lora_restore_path={config.lora.lora_restore_path}.")
  state["model"] = nnx.merge_state(state.model, adapters)
  return state


def reload_base(state: nnx.State, config, mesh) -> nnx.State:
  """`state` with its frozen base weights read again from `load_parameters_path`.

  An adapter checkpoint holds no base, and MaxText skips `load_parameters_path` once the run directory has a
  checkpoint, so without this a resumed LoRA run would train on a freshly initialised base instead of the one it
  started from. Under QLoRA the checkpoint holds full-precision weights while the state holds qwix's quantized
  codes: MaxText's loader builds the full-precision model from the checkpoint and qwix quantizes it exactly as at
  model creation, so a QLoRA run always starts from (and resumes on) the quantized checkpoint.
  """
  # A scalar head is trained beside the adapters (adapter_checkpoint), so it is not part of the frozen base.
  frozen = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam), nnx.Not(nnx.PathContains("scalar_head")))
  base = state.model.filter(frozen)
  if config.lora.lora_weight_qtype:
    quantized = nnx.state(_pretrained_with_adapters(config, mesh), frozen)
    loaded = jax.tree.map(lambda new, old: jax.device_put(new, old.sharding), quantized, base)
  else:
    loaded = load_like(config.load_parameters_path, base, config)
  state["model"] = nnx.merge_state(state.model, loaded)
  return state


def prepare_start(config, checkpoint_manager, abstract_state, resuming: bool):
  """LoRA's checks before a trained role's state is restored or initialised, in order, before any weights load: a
  resumed run keeps its `lora.lora_restore_path`; a fresh run's restore source holds adapters this model takes.
  Returns the config MaxText's `setup_training_state` runs with: under QLoRA without `load_parameters_path`, since
  its quantized codes cannot be filled from a full-precision checkpoint (`finish_start` quantizes it instead)."""
  checkpoint_guard.check_same_adapter_source(checkpoint_manager, config)
  if config.lora.lora_restore_path and not resuming:
    check_restore_source(nnx.state(abstract_state.model, nnx.LoRAParam), config)
  if config.lora.lora_weight_qtype and config.load_parameters_path:
    return pyconfig.HyperParameters(
        config._pydantic_config.model_copy(update={"load_parameters_path": ""})  # pylint: disable=protected-access
    )
  return config


def finish_start(state: nnx.State, config, mesh, resuming: bool) -> nnx.State:
  """The restored or initialised `state` completed for LoRA: its frozen base read from `load_parameters_path`
  (an adapter checkpoint holds none; QLoRA quantizes it), then, on a fresh run, the adapters of
  `lora.lora_restore_path` (a resumed run reads its own, as MaxText does)."""
  if (resuming or config.lora.lora_weight_qtype) and config.load_parameters_path:
    state = reload_base(state, config, mesh)
  if config.lora.lora_restore_path and not resuming:
    state = restore_adapters(state, config)
  return state

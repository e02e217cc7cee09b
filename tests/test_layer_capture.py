"""Layer capture: attention probabilities and out-projection activations read from MaxText's own forward pass."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.linen import partitioning as nn_partitioning

from maxtext.layers import attention_op
from maxtext.utils import maxtext_utils
from maxtext.utils import model_creation_utils
from maxtext_posttrain import config as posttrain_config
from maxtext_posttrain import forward
from maxtext_posttrain import layer_capture

# Row 0 packs two sequences and 3 padding tokens; row 1 is one sequence.
SEGMENTATION = np.array([[1] * 6 + [2] * 7 + [0] * 3, [1] * 16], np.int32)
POSITIONS = np.array([list(range(6)) + list(range(7)) + list(range(3)), list(range(16))], np.int32)
INPUTS = np.random.default_rng(0).integers(3, 500, SEGMENTATION.shape).astype(np.int32)
ALLOWED = (SEGMENTATION[:, :, None] == SEGMENTATION[:, None, :]) & np.tri(16, dtype=bool)  # [B, Tq, Tk]


class _QueryKeySowing(attention_op.AttentionOp):
  """MaxText's AttentionOp, also sowing the query and key it attends with: MaxText's, after RoPE and its query
  scaling, which the probabilities are checked against."""

  def apply_attention_dot(self, query, key, *args, **kwargs):
    self.sow(nnx.Intermediate, "query", query, capture_noop=True)
    self.sow(nnx.Intermediate, "key", key, capture_noop=True)
    return super().apply_attention_dot(query, key, *args, **kwargs)


@dataclasses.dataclass
class _Run:
  """A model's outputs before `enable_capture` and from two calls after it, on the batch above."""

  config: object
  mesh: jax.sharding.Mesh
  model: nnx.Module  # with capture enabled (and the query and key sown)
  plain_logits: jax.Array  # the same weights before capture was enabled
  maxtext_features: jax.Array | None  # MaxText's own read of its sown out-projection activations
  final_hidden: jax.Array  # the decoder's last hidden state (before the final norm), as MaxText's decoder returns it
  logits: jax.Array
  captures: layer_capture.Captures
  again: layer_capture.Captures  # a second call on the same module
  left_on_model: nnx.State  # intermediates on that module after both calls


def _run(tmp_path_factory, tfds_dir, *overrides) -> _Run:
  """One model of sft.yml's decoder run, under jit over a split state, before and after capture is enabled."""
  argv = ["", "sft.yml", "run_name=capture", f"base_output_directory={tmp_path_factory.mktemp('capture')}"]
  config = posttrain_config.initialize(argv + [f"dataset_path={tfds_dir}", *overrides])
  mesh = maxtext_utils.get_mesh_from_config(config)
  args = (INPUTS, POSITIONS, SEGMENTATION)
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
    model = model_creation_utils.get_nnx_create_model_fn(config, mesh)()
    graphdef, state = nnx.split(model)

    @jax.jit
    def plain(state):
      model = nnx.merge(graphdef, state)
      logits = forward.logits(model, *args)
      features = maxtext_utils.get_intermediate_value(model, "out_projection_activations", clear=True)
      _, hidden, _ = model.decoder(
          shared_embedding=model.token_embedder,
          decoder_input_tokens=INPUTS,
          decoder_positions=POSITIONS,
          decoder_segment_ids=SEGMENTATION,
          deterministic=True,
          model_mode="train",
      )
      return logits, features, hidden

    plain_logits, maxtext_features, final_hidden = plain(state)
    for _, module in nnx.iter_modules(model):
      if isinstance(module, attention_op.AttentionOp):
        module.__class__ = _QueryKeySowing
    layer_capture.enable_capture(model, features=config.distill_beta > 0, hidden=True)
    graphdef, state = nnx.split(model)

    @jax.jit
    def captured(state):
      model = nnx.merge(graphdef, state)
      logits, captures = layer_capture.forward_with_captures(model, *args)
      _, again = layer_capture.forward_with_captures(model, *args)
      return logits, captures, again, nnx.state(model, nnx.Intermediate)

    return _Run(config, mesh, model, plain_logits, maxtext_features, final_hidden, *captured(state))


@pytest.fixture(scope="module")
def scanned(tmp_path_factory, tfds_dir):
  """sft.yml's scanned decoder with distill_beta > 0, so that MaxText sows its out-projection activations."""
  return _run(tmp_path_factory, tfds_dir, "distill_beta=0.5")


@pytest.fixture(scope="module")
def unscanned(tmp_path_factory, tfds_dir):
  """The decoder with scan_layers=false (which MaxText allows only with distill_beta=0: no features) and grouped
  query attention (2 kv heads for 4 query heads)."""
  return _run(tmp_path_factory, tfds_dir, "scan_layers=false", "base_num_kv_heads=2")


@pytest.mark.parametrize("name", ["scanned", "unscanned"])
def test_attention_is_the_masked_softmax_of_each_layers_own_query_and_key(name, request):
  """Layer l's probabilities are softmax(q k^T) of the query and key MaxText's layer l attends with (grouped query
  heads reading their kv head), over the keys its causal and packing masks allow: rows sum to 1, nothing above the
  diagonal or across segments (padding, segment 0, attends to padding)."""
  run = request.getfixturevalue(name)
  attention = np.asarray(run.captures.attention)
  layers, heads = run.config.num_decoder_layers, run.config.num_query_heads
  assert attention.shape == (layers, len(SEGMENTATION), heads, 16, 16), attention.shape
  query = layer_capture.stacked(run.model, run.captures.intermediates, "query")  # [layers, B, T, heads, head_dim]
  key = layer_capture.stacked(run.model, run.captures.intermediates, "key")  # [layers, B, T, kv_heads, head_dim]
  key = jnp.repeat(key, heads // run.config.num_kv_heads, axis=3)  # query head h reads kv head h // group size
  logits = jnp.einsum("lbqhd,lbkhd->lbhqk", query, key)
  expected = jax.nn.softmax(jnp.where(ALLOWED[None, :, None], logits, -jnp.inf), axis=-1)
  np.testing.assert_allclose(attention, expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(attention.sum(-1), 1.0, atol=1e-5)
  assert np.all(np.where(ALLOWED[None, :, None], 0.0, attention) == 0.0)
  assert np.all(attention[:, 0, :, 6, :6] == 0.0) and attention[:, 0, :, 6, 6].min() > 0.0  # a segment's start
  assert (run.captures.features is None) == (name == "unscanned")


def test_features_are_the_out_projection_activations_maxtext_sows(scanned):
  """[layers, B, T, emb] out-projection activations, as MaxText's own get_intermediate_value reads them."""
  features = scanned.captures.features
  assert features.shape == (scanned.config.num_decoder_layers, *SEGMENTATION.shape, scanned.config.emb_dim)
  np.testing.assert_array_equal(features, scanned.maxtext_features)


@pytest.mark.parametrize("name", ["scanned", "unscanned"])
def test_hidden_states_are_each_decoder_layers_output(name, request):
  """[layers, B, T, emb]: the last is the hidden state MaxText's decoder hands its final norm and LM head."""
  run = request.getfixturevalue(name)
  hidden = run.captures.hidden
  assert hidden.shape == (run.config.num_decoder_layers, *SEGMENTATION.shape, run.config.emb_dim)
  np.testing.assert_array_equal(hidden[-1], run.final_hidden)
  assert not np.allclose(hidden[0], hidden[-1])


@pytest.mark.parametrize("name", ["scanned", "unscanned"])
def test_capture_leaves_the_logits_and_the_model_as_they_were(name, request):
  """Logits with capture equal the model's before it was enabled; a second call on the same module captures the
  same values (nothing accumulates) and no intermediate stays on the model."""
  run = request.getfixturevalue(name)
  np.testing.assert_allclose(run.logits, run.plain_logits, rtol=0, atol=1e-6)
  np.testing.assert_array_equal(run.again.attention, run.captures.attention)
  assert not run.left_on_model, run.left_on_model


def test_gradients_reach_the_student_through_its_attention(scanned):
  """A loss on the captured probabilities (the expected key position) differentiates the query and key kernels,
  finitely, through MaxText's scanned layers."""
  graphdef, params, rest = nnx.split(scanned.model, nnx.Param, ...)

  def loss(params, rest):
    model = nnx.merge(graphdef, params, rest, copy=True)
    _, captures = layer_capture.forward_with_captures(model, INPUTS, POSITIONS, SEGMENTATION)
    return jnp.sum(captures.attention * jnp.arange(16))

  with jax.set_mesh(scanned.mesh), nn_partitioning.axis_rules(scanned.config.logical_axis_rules):
    grads = jax.jit(jax.grad(loss))(params, rest)
  norms = {path: float(jnp.linalg.norm(g.get_value())) for path, g in nnx.to_flat_state(grads)}
  assert all(np.isfinite(n) for n in norms.values()), norms
  attention_params = ("decoder", "layers", "self_attention")
  assert norms[(*attention_params, "query", "kernel")] > 0 and norms[(*attention_params, "key", "kernel")] > 0


def test_capture_refuses_what_it_cannot_read(scanned, unscanned):
  """Features need distill_beta > 0 (MaxText sows them only then); probabilities need the dot-product kernel."""
  with pytest.raises(ValueError, match="distill_beta"):
    layer_capture.enable_capture(unscanned.model, attention=False, features=True)
  flash = posttrain_config.with_overrides(scanned.config, attention="flash")
  _, abstract = model_creation_utils.create_nnx_abstract_model(flash, scanned.mesh)
  with pytest.raises(ValueError, match="dot_product"):
    layer_capture.enable_capture(abstract)

"""Greedy decoding with MaxText's KV cache must pick the tokens a full recomputation picks.

The reference is the plain training-mode model run on the whole growing sequence at every step (what the cache
saves), so a mismatch in cache layout, padding masks, positions or the parameter line-up shows up as a different
token. The model is the sft.yml decoder with random weights; its output projection is scaled so that the
top two logits are far apart and greedy choices cannot flip on float rounding (the margin is asserted).
"""

import functools
import json
import os
import subprocess
import sys
import tempfile

from flax import nnx
from flax.linen import partitioning as nn_partitioning
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext.utils import maxtext_utils
from maxtext.utils import maxtext_utils_nnx
from maxtext.utils import model_creation_utils
from maxtext_posttrain import config as posttrain_config
from maxtext_posttrain.rollout import Sampler
from maxtext_posttrain.rollout import sampler as sampler_module
from tests import paths
from tests import run_utils

REPO = str(paths.REPO)
PREFILL_LENGTH = 64  # sft.yml max_prefill_predict_length
PROMPT_LENGTHS = (5, 30, 17, 1, PREFILL_LENGTH, 9, 12)
MAX_NEW_TOKENS = 10
LOGIT_SCALE = 8.0
NO_EOS = -1


def _prompts():
  rng = np.random.default_rng(0)
  return [rng.integers(3, 512, size=n).tolist() for n in PROMPT_LENGTHS]


def _build(overrides=()):
  """Config, mesh, the trainer-mode model (fixed seed, scaled logits) and its params."""
  config = posttrain_config.initialize(
      ["", "sft.yml", "run_name=t", f"base_output_directory={tempfile.gettempdir()}"] + list(overrides)
  )
  mesh = maxtext_utils.get_mesh_from_config(config)
  create_model, abstract_model = model_creation_utils.create_nnx_abstract_model(config, mesh)
  model = maxtext_utils_nnx.create_nnx_sharded_model(abstract_model, create_model, mesh)
  kernel = model.decoder.logits_dense.kernel
  kernel.set_value(kernel.get_value() * LOGIT_SCALE)
  return config, mesh, model, nnx.state(model, nnx.Param)


class _Setup:
  """Session-wide model, sampler and full-recomputation reference, so each program compiles once."""

  def __init__(self, overrides=()):
    self.config, self.mesh, self.model, self.params = _build(overrides)
    self.sampler = Sampler(self.config, self.mesh)
    graphdef, _, rest = nnx.split(self.model, nnx.Param, ...)

    @jax.jit
    def next_token(params, tokens, lengths):
      """Train-mode forward over the whole (right-padded) sequence; argmax and top-2 margin at each last token."""
      model = nnx.merge(graphdef, params, rest, copy=True)
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
      segment_ids = (positions < lengths[:, None]).astype(jnp.int32)
      logits = model(tokens, positions, decoder_segment_ids=segment_ids, enable_dropout=False)
      last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
      top2 = jax.lax.top_k(last, 2)[0]
      return jnp.argmax(last, axis=-1), top2[:, 0] - top2[:, 1]

    @jax.jit
    def full_logits(params, tokens, lengths):
      """Train-mode logits [batch, length, vocab] of right-padded sequences: the trainer's forward pass."""
      model = nnx.merge(graphdef, params, rest, copy=True)
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
      segment_ids = (positions < lengths[:, None]).astype(jnp.int32)
      return model(tokens, positions, decoder_segment_ids=segment_ids, enable_dropout=False)

    self._next_token = next_token
    self._full_logits = full_logits

  def full_logits(self, params, sequences):
    """Float32 numpy logits of one full forward over each token sequence (right-padded to the longest)."""
    tokens = np.zeros((len(sequences), max(len(s) for s in sequences)), np.int32)
    for i, sequence in enumerate(sequences):
      tokens[i, : len(sequence)] = sequence
    lengths = np.array([len(s) for s in sequences], np.int32)
    with jax.set_mesh(self.mesh), nn_partitioning.axis_rules(self.config.logical_axis_rules):
      return np.asarray(jax.device_get(self._full_logits(params, tokens, lengths)), np.float32)

  def reference(self, prompts, max_new_tokens):
    """Greedy tokens by full recomputation, one step at a time, and the smallest top-2 logit margin seen."""
    tokens = np.zeros((len(prompts), PREFILL_LENGTH + max_new_tokens), np.int32)
    lengths = np.array([len(p) for p in prompts], np.int32)
    for i, prompt in enumerate(prompts):
      tokens[i, : len(prompt)] = prompt
    generated, margin = [[] for _ in prompts], np.inf
    with jax.set_mesh(self.mesh), nn_partitioning.axis_rules(self.config.logical_axis_rules):
      for _ in range(max_new_tokens):
        token, gap = jax.device_get(self._next_token(self.params, tokens, lengths))
        margin = min(margin, float(gap.min()))
        for i in range(len(prompts)):
          generated[i].append(int(token[i]))
          tokens[i, lengths[i]] = token[i]
        lengths = lengths + 1
    return generated, margin


@functools.cache
def shared_setup(overrides: tuple[str, ...] = ()) -> _Setup:
  """One `_Setup` per process and config overrides, also used by tests/test_sampling.py so the model and programs
  build once."""
  return _Setup(overrides)


@pytest.fixture(scope="session")
def setup():
  return shared_setup()


@pytest.fixture(scope="session")
def reference(setup):
  generated, margin = setup.reference(_prompts(), MAX_NEW_TOKENS)
  assert margin > 1e-2, f"random model too flat for an unambiguous greedy comparison (margin {margin})"
  return generated


def test_cached_greedy_matches_full_recomputation(setup, reference):
  assert setup.sampler.generate(setup.params, _prompts(), MAX_NEW_TOKENS, eos_id=NO_EOS) == reference
  # sft.yml scans its layers; decoding slices them into the unscanned graph (the fast path).
  programs = setup.sampler._programs.values()  # pylint: disable=protected-access
  assert programs and all(graphs.unscan for graphs, _ in programs)  # the session's other sampling tests add programs


def test_scanned_decode_graph_matches_too(setup, reference, monkeypatch):
  """The fallback for layer stacks that do not unscan: the scanned decode graph on the trainer's scanned params."""
  monkeypatch.setattr(sampler_module, "_maps_onto", lambda *_: False)
  sampler = Sampler(setup.config, setup.mesh)
  assert sampler.generate(setup.params, _prompts(), MAX_NEW_TOKENS, eos_id=NO_EOS) == reference
  assert not [graphs.unscan for graphs, _ in sampler._programs.values()][0]  # pylint: disable=protected-access


def test_eos_stops_each_sequence_and_is_included(setup, reference):
  eos_id = reference[1][3]
  expected = [r[: r.index(eos_id) + 1] if eos_id in r else r for r in reference]
  assert len(expected[1]) <= 4
  assert setup.sampler.generate(setup.params, _prompts(), MAX_NEW_TOKENS, eos_id=eos_id) == expected


def test_all_sequences_at_eos(setup, reference):
  eos_id = reference[3][0]  # prompt 3's first new token
  assert setup.sampler.generate(setup.params, [_prompts()[3]] * 2, MAX_NEW_TOKENS, eos_id=eos_id) == [[eos_id]] * 2


def test_same_shapes_compile_once(setup):
  sampler = Sampler(setup.config, setup.mesh)
  prompts = _prompts()
  sampler.generate(setup.params, prompts, 4, eos_id=NO_EOS)
  sampler.generate(setup.params, prompts[::-1], 4, eos_id=2)
  assert sampler.num_compiles == 1
  sampler.generate(setup.params, prompts, 5, eos_id=NO_EOS)
  assert sampler.num_compiles == 2


def test_prompt_too_long_raises(setup):
  prompts = [[5, 6], [7] * (PREFILL_LENGTH + 1)]
  with pytest.raises(ValueError, match=f"Prompt 1 has {PREFILL_LENGTH + 1} tokens"):
    setup.sampler.generate(setup.params, prompts, MAX_NEW_TOKENS, eos_id=NO_EOS)


def test_params_that_do_not_line_up_raise(setup):
  params = jax.tree.map(lambda x: x, setup.params)
  params["token_embedder"]["embedding"].set_value(params["token_embedder"]["embedding"].get_value()[:-1])
  with pytest.raises(ValueError, match="do not line up"):
    setup.sampler.generate(params, [[5, 6]], MAX_NEW_TOKENS, eos_id=NO_EOS)


def test_sharded_mesh_gives_the_same_tokens(reference):
  """4 fake CPU devices: same weights from the same seed, same greedy tokens; 7 prompts pad to 8.

  The rollout mesh is fsdp=2 x tensor=2. Params built on it are used in place; params built on another trainer mesh
  (fsdp=4) are resharded onto it and give the same tokens.
  """
  python_path = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
  env = dict(os.environ, XLA_FLAGS=run_utils.xla_flags(4), JAX_PLATFORMS="cpu", PYTHONPATH=python_path)
  overrides = ["ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"]
  result = subprocess.run(
      [sys.executable, __file__, *overrides], env=env, cwd=REPO, capture_output=True, text=True, check=False
  )
  assert result.returncode == 0, result.stderr[-3000:]
  out = json.loads(result.stdout.strip().splitlines()[-1])
  assert out["in_place"] == out["resharded"] == reference
  assert out["in_place_uses_params_as_given"] and out["resharded_onto_rollout_mesh"]


if __name__ == "__main__":
  _config, _mesh, _, _params = _build(sys.argv[1:])
  assert len(jax.devices()) == _mesh.size == 4, _mesh
  _sampler = Sampler(_config, _mesh)
  _, _trainer_mesh, _, _trainer_params = _build(["ici_fsdp_parallelism=4"])
  _resharded = _sampler.on_mesh(_trainer_params)
  _targets = [a.sharding for a in jax.tree.leaves(_sampler.abstract_params)]
  print(
      json.dumps(
          {
              "in_place": _sampler.generate(_params, _prompts(), MAX_NEW_TOKENS, eos_id=NO_EOS),
              "resharded": _sampler.generate(_trainer_params, _prompts(), MAX_NEW_TOKENS, eos_id=NO_EOS),
              "in_place_uses_params_as_given": _sampler.on_mesh(_params) is _params,
              "resharded_onto_rollout_mesh": all(
                  x.sharding == t and x.sharding != y.sharding
                  for x, y, t in zip(jax.tree.leaves(_resharded), jax.tree.leaves(_trainer_params), _targets)
                  if x.ndim
              ),
          }
      )
  )

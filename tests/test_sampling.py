"""RL sampling: B prompts x N samples, log-probs equal to the trainer's, the sampled distribution, stops, bad input,
a vocabulary padded past the tokenizer, and ahead-of-time compilation for a TPU topology.

Reuses tests/test_rollout.py's session model (sft.yml decoder, random weights, output projection scaled by 8)
and its train-mode forward as the reference. Distribution tests use a flatter copy of the weights (output projection
scaled by 8/3) so that many tokens have visible probability, and compare first-token frequencies over thousands of
samples of one prompt with the distribution the strategy defines, by a chi-square test with a fixed seed.
"""

import jax
import numpy as np
import pytest
from scipy import stats

from maxtext.inference import inference_utils
from maxtext.trainers.pre_train import train_compile
from maxtext_posttrain import config as config_lib
from maxtext_posttrain.data import pipeline
from maxtext_posttrain.losses import cross_entropy
from maxtext_posttrain.losses import logprobs
from maxtext_posttrain.rollout import Sampler, SamplingParams
from maxtext_posttrain.rollout import sampler as sampler_module
from tests import test_rollout

NO_EOS = test_rollout.NO_EOS
NUM_DRAWS = 4000
NUM_PIECES = 512  # the bundled sentencepiece tokenizer's


@pytest.fixture(scope="session")
def setup():
  return test_rollout.shared_setup()


@pytest.fixture(scope="session")
def padded_setup():
  """The session model with MaxText-style vocabulary padding: 1024 embedding rows over the 512-piece tokenizer."""
  return test_rollout.shared_setup(("vocab_size=1024",))


@pytest.fixture(scope="session")
def flat_params(setup):
  """The session weights with a flatter output distribution (same shapes, so the same compiled programs)."""
  params = jax.tree.map(lambda x: x, setup.params)
  kernel = params["decoder"]["logits_dense"]["kernel"]
  kernel.set_value(kernel.get_value() / 3.0)
  return params


def _sample(setup, params, prompts, sampling, num_samples=1, max_new_tokens=8, eos_id=NO_EOS, seed=0, **kwargs):
  return setup.sampler.sample(
      params, prompts, max_new_tokens, eos_id, jax.random.key(seed), sampling, num_samples=num_samples, **kwargs
  )


def _teacher_forced(setup, temperature):
  """Rollouts of prompts 0-2 x 2 samples and the logits of one train-mode forward at each completion token."""
  prompts = test_rollout._prompts()[:3]  # pylint: disable=protected-access
  rollouts = _sample(setup, setup.params, prompts, SamplingParams("weighted", temperature), num_samples=2)
  sequences = [p + c for p, c in zip(rollouts.prompts, rollouts.completions())]
  logits = setup.full_logits(setup.params, sequences)
  at = [np.arange(len(p) - 1, len(p) + len(c) - 1) for p, c in zip(rollouts.prompts, rollouts.completions())]
  return rollouts, [logits[row, positions] for row, positions in enumerate(at)]


@pytest.mark.parametrize("which", ["setup", "padded_setup"], ids=["vocab_512", "vocab_1024"])
def test_logprobs_equal_teacher_forced_full_forward(request, which):
  """Per-token log-probs of sampled completions = log softmax(logits / T) of one train-mode forward (float32), over
  the ids the tokenizer decodes (all 512 of vocab_512; the first 512 of vocab_1024's 1024)."""
  temperature = 0.7
  rollouts, logits = _teacher_forced(request.getfixturevalue(which), temperature)
  for row, completion in enumerate(rollouts.completions()):
    masked = logprobs.mask_undecodable(logits[row], NUM_PIECES)
    expected = np.asarray(logprobs.token_logprobs(masked, np.array(completion), temperature))
    np.testing.assert_allclose(rollouts.logprobs[row, : len(completion)], expected, atol=1e-4)


def test_a_padded_vocabulary_samples_only_ids_the_tokenizer_decodes(padded_setup):
  """With 1024 embedding rows over 512 pieces, the random model mostly prefers padding ids; none is sampled, and
  every completion decodes (sentencepiece raises OUT_OF_RANGE on a padding id)."""
  rollouts, logits = _teacher_forced(padded_setup, 0.7)
  preferred = np.concatenate([row.argmax(-1) for row in logits])
  assert np.mean(preferred >= NUM_PIECES) > 0.25, "too few padding ids preferred for a meaningful test"
  assert rollouts.tokens.max() < NUM_PIECES
  encoder = pipeline.Encoder.from_config(padded_setup.config)
  assert encoder.num_pieces == padded_setup.sampler.num_pieces == NUM_PIECES
  assert all(isinstance(encoder.decode_completion(c), str) for c in rollouts.completions())


def test_logprobs_at_temperature_one_are_minus_the_trainer_cross_entropy(setup):
  """At T = 1 a completion's summed log-prob is minus the SFT loss's cross entropy over the same tokens."""
  prompts = test_rollout._prompts()[3:5]  # pylint: disable=protected-access
  rollouts = _sample(setup, setup.params, prompts, SamplingParams("weighted", 1.0), num_samples=2)
  sequences = [p + c for p, c in zip(rollouts.prompts, rollouts.completions())]
  logits = setup.full_logits(setup.params, sequences)
  for row, (prompt, completion) in enumerate(zip(rollouts.prompts, rollouts.completions())):
    targets = np.zeros(logits.shape[1], np.int32)
    weights = np.zeros(logits.shape[1], np.float32)
    targets[len(prompt) - 1 : len(prompt) + len(completion) - 1] = completion
    weights[len(prompt) - 1 : len(prompt) + len(completion) - 1] = 1.0
    total, _, _ = cross_entropy.token_cross_entropy(logits[row], targets, weights)
    np.testing.assert_allclose(rollouts.logprobs[row].sum(), -float(total), rtol=1e-5, atol=1e-4)


def _first_token_distribution(setup, params, sampling):
  """The distribution `sampling` defines over prompt 0's first new token, from one train-mode forward (float64)."""
  prompt = test_rollout._prompts()[0]  # pylint: disable=protected-access
  logits = setup.full_logits(params, [prompt])[0, len(prompt) - 1].astype(np.float64)
  keep = np.ones_like(logits, bool)
  if sampling.strategy == "topk":
    keep = logits >= np.sort(logits)[-sampling.top_k]
  if sampling.strategy == "nucleus":  # MaxText's: the nucleus of the untempered distribution, then T
    probs = np.exp(logits - logits.max())
    cumulative = np.cumsum(np.sort(probs / probs.sum())[::-1])
    assert np.min(np.abs(cumulative - sampling.top_p)) > 1e-3, "top_p too close to a cut-off for a stable test"
    keep = logits >= np.sort(logits)[::-1][np.sum(cumulative < sampling.top_p)]
  scaled = np.where(keep, logits / sampling.temperature, -np.inf)
  probs = np.exp(scaled - scaled.max())
  return prompt, probs / probs.sum()


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams("weighted", 1.3), SamplingParams("topk", 1.3, top_k=6), SamplingParams("nucleus", 1.3, top_p=0.6)],
    ids=["temperature", "top_k", "top_p"],
)
def test_first_token_frequencies_match_the_distribution(setup, flat_params, sampling):
  prompt, expected = _first_token_distribution(setup, flat_params, sampling)
  rollouts = _sample(setup, flat_params, [prompt], sampling, num_samples=NUM_DRAWS, max_new_tokens=1, seed=1)
  counts = np.bincount(rollouts.tokens[:, 0], minlength=expected.size)
  assert counts[expected == 0].sum() == 0, "sampled a token outside the top-k / top-p set"
  expected_counts = expected * NUM_DRAWS
  big = expected_counts >= 5  # chi-square needs expected counts of 5+; the rest are pooled into one bin
  observed = np.append(counts[big], counts[~big].sum())
  pooled = np.append(expected_counts[big], expected_counts[~big].sum())
  if pooled[-1] < 5:
    observed, pooled = observed[:-1], pooled[:-1] * observed[:-1].sum() / pooled[:-1].sum()
  assert big.sum() >= 4, f"too few likely tokens for a meaningful test ({big.sum()})"
  assert stats.chisquare(observed, pooled).pvalue > 1e-3


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_greedy_and_weighted_draw_the_tokens_maxtexts_sampling_draws(temperature):
  """The sampler's own greedy and weighted draws (an argmax XLA:CPU runs faster) pick MaxText's tokens, ties included:
  the first index of the maximum, and `jax.random.categorical`'s Gumbel draw from each row's key."""
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(64, 1024)).astype(np.float32)
  logits[:8, 100:110] = 50.0  # ties at the maximum
  logits[8:16] = 0.0  # a whole row tied
  keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.key(3), np.arange(64))
  for strategy in ("greedy", "weighted"):
    maxtext = jax.vmap(
        lambda row, key, s=strategy: inference_utils.sampling(row, key, s, temperature=temperature)  # pylint: disable=cell-var-from-loop
    )(logits, keys)
    ours = SamplingParams(strategy, temperature).draw(logits, keys)
    np.testing.assert_array_equal(ours, maxtext, err_msg=strategy)
  assert SamplingParams("greedy").draw(logits, keys)[:16].tolist() == [100] * 8 + [0] * 8


def test_cpu_cache_layout_decodes_what_another_layout_decodes(setup):
  """On a CPU mesh MaxText's default KV-cache order (sequence, heads, batch, kv) decodes as (batch, heads, sequence,
  kv); a TPU keeps it, and so does an order the config sets. The layout changes no token and log-probs only by
  float32 rounding (the same sums in another order)."""
  default = setup.config.ar_cache_axis_order
  for platform, expected in (("cpu", "0,2,1,3"), ("tpu", default)):
    decode = sampler_module._decode_config(setup.config, 2, 16, 8, False, platform)  # pylint: disable=protected-access
    assert (decode.ar_cache_axis_order, decode.prefill_cache_axis_order) == (expected, expected), platform
  other = config_lib.with_overrides(setup.config, ar_cache_axis_order="0,1,2,3", prefill_cache_axis_order="0,1,2,3")
  assert sampler_module._decode_config(other, 2, 16, 8, False, "cpu").ar_cache_axis_order == "0,1,2,3"  # pylint: disable=protected-access
  prompts, sampling = test_rollout._prompts()[:3], SamplingParams("weighted", 1.0)  # pylint: disable=protected-access
  ours = _sample(setup, setup.params, prompts, sampling, num_samples=2)
  theirs = Sampler(other, setup.mesh).sample(setup.params, prompts, 8, NO_EOS, jax.random.key(0), sampling, num_samples=2)
  np.testing.assert_array_equal(ours.tokens, theirs.tokens)
  np.testing.assert_allclose(ours.logprobs, theirs.logprobs, atol=1e-5)


def test_samples_of_one_prompt_differ_and_rng_is_per_call(setup):
  prompt = test_rollout._prompts()[1]  # pylint: disable=protected-access
  sampling = SamplingParams("weighted", 1.0)
  first = _sample(setup, setup.params, [prompt], sampling, num_samples=4).completions()
  assert len({tuple(c) for c in first}) == 4, first
  assert _sample(setup, setup.params, [prompt], sampling, num_samples=4).completions() == first  # same key
  assert _sample(setup, setup.params, [prompt], sampling, num_samples=4, seed=7).completions() != first


def test_prompts_are_prefilled_once_and_broadcast_to_their_samples(setup):
  """Greedy N samples of each prompt are N copies of the single-sample continuation: the cache rows line up. The
  prefill cache holds one row per prompt, the decode cache N, and both are sized from the request: the prompt bucket
  and max_new_tokens, not max_prefill_predict_length or max_target_length."""
  prompts = [p[:10] for p in test_rollout._prompts()[1:4]]  # pylint: disable=protected-access
  single = _sample(setup, setup.params, prompts, SamplingParams(), num_samples=1, max_new_tokens=5).completions()
  repeated = _sample(setup, setup.params, prompts, SamplingParams(), num_samples=3, max_new_tokens=5).completions()
  assert repeated == [c for c in single for _ in range(3)]
  (batch, bucket, samples, max_new, _), (graphs, _) = list(setup.sampler._programs.items())[-1]  # pylint: disable=protected-access
  assert (bucket, samples, max_new) == (16, 3, 5)
  prefill_dims = {d for leaf in jax.tree.leaves(graphs.abstract_prefill_cache) for d in leaf.shape}
  decode_dims = {d for leaf in jax.tree.leaves(graphs.abstract_cache) for d in leaf.shape}
  assert batch in prefill_dims and batch * 3 in decode_dims and batch not in decode_dims
  assert 16 in prefill_dims and 5 in decode_dims
  assert not {setup.config.max_prefill_predict_length, setup.config.max_target_length} & (prefill_dims | decode_dims)


def test_eos_and_stop_tokens_end_a_sample_and_nothing_after_is_scored(setup):
  prompts = test_rollout._prompts()[:2]  # pylint: disable=protected-access
  sampling = SamplingParams("weighted", 1.0)
  free = _sample(setup, setup.params, prompts, sampling, num_samples=2)
  assert free.finish_reasons == ["length"] * 4 and (free.lengths == 8).all()
  eos_id, stop_id = int(free.tokens[0, 2]), int(free.tokens[3, 4])
  stopped = _sample(setup, setup.params, prompts, sampling, num_samples=2, eos_id=eos_id, stop_ids=(stop_id,))
  for row in range(4):
    full = free.tokens[row].tolist()
    end = min([full.index(t) + 1 for t in (eos_id, stop_id) if t in full] + [8])
    assert stopped.lengths[row] == end
    assert stopped.tokens[row, :end].tolist() == full[:end]  # per-(sample, step) keys: same draws up to the stop
    assert (stopped.tokens[row, end:] == stopped.pad_id).all() and (stopped.logprobs[row, end:] == 0).all()
    np.testing.assert_allclose(stopped.logprobs[row, :end], free.logprobs[row, :end], atol=1e-5)
    assert stopped.finish_reasons[row] == ("eos" if end < 8 or full[7] in (eos_id, stop_id) else "length")
  assert stopped.lengths[0] <= 3 and stopped.lengths[3] <= 5


def test_long_prompts_are_truncated_from_the_left_and_counted(setup):
  long_prompt = list(range(3, 3 + test_rollout.PREFILL_LENGTH + 6))
  kept = long_prompt[-test_rollout.PREFILL_LENGTH :]
  rollouts = _sample(setup, setup.params, [long_prompt, [5, 6]], SamplingParams(), truncate_prompts=True)
  assert rollouts.num_truncated_prompts == 1 and rollouts.prompts[0] == kept
  assert rollouts.completions()[0] == _sample(setup, setup.params, [kept], SamplingParams()).completions()[0]
  with pytest.raises(ValueError, match="more than max_prefill_predict_length"):
    _sample(setup, setup.params, [long_prompt], SamplingParams(), truncate_prompts=False)


def test_same_bucket_compiles_once(setup):
  sampler = Sampler(setup.config, setup.mesh)
  sampling = SamplingParams("topk", 1.0, top_k=5)
  prompts = test_rollout._prompts()[:3]  # pylint: disable=protected-access
  for seed in range(3):
    sampler.sample(setup.params, prompts, 4, NO_EOS, jax.random.key(seed), sampling, num_samples=2)
  assert sampler.num_compiles == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"strategy": "beam"}, "decode_sampling_strategy"),
        ({"strategy": "weighted", "temperature": 0.0}, "temperature"),
        ({"strategy": "topk", "top_k": 0}, "top_k"),
        ({"strategy": "nucleus", "top_p": 0.0}, r"\(0, 1\]"),
        ({"strategy": "nucleus", "top_p": 1.5}, r"\(0, 1\]"),
    ],
)
def test_bad_sampling_settings_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    SamplingParams(**kwargs)


def test_bad_requests_raise(setup):
  with pytest.raises(ValueError, match="num_samples must be at least 1"):
    _sample(setup, setup.params, [[5, 6]], SamplingParams(), num_samples=0)
  with pytest.raises(ValueError, match="Prompt 1 is empty"):
    _sample(setup, setup.params, [[5, 6], []], SamplingParams())


def test_sampling_defaults_come_from_maxtext_keys(make_config):
  config = make_config(
      "decode_sampling_strategy=composite",
      "decode_sampling_temperature=0.7",
      "decode_sampling_top_k=5",
      "decode_sampling_nucleus_p=0.9",
  )
  assert SamplingParams.from_config(config) == SamplingParams("composite", 0.7, 5, 0.9)
  assert SamplingParams.from_config(make_config()).top_p == 1.0  # MaxText's -1 means "no nucleus"


# MaxText's persistent compilation cache (jax_cache_dir) keeps the TPU program of an earlier run, which a host
# without a TPU client cannot load back; jax says so and compiles again.
@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry:UserWarning")
def test_decode_program_compiles_ahead_of_time_for_a_tpu_topology(make_config):
  """On MaxText's v5p-8 compile topology (4 TPU chips this host lacks; libtpu compiles) the sampler builds and its
  decode program lowers from abstract inputs and compiles: building runs nothing, the batch pads as `sample` pads."""
  config = make_config("compile_topology=v5p-8", "compile_topology_num_slices=1")
  mesh = train_compile.get_topology_mesh(config)
  assert mesh.devices.size == 4 and {d.platform for d in mesh.devices.flat} == {"tpu"}
  sampler = Sampler(config, mesh)
  sampling = SamplingParams("weighted", 1.0)
  compiled = sampler.lower(3, 20, num_samples=2, max_new_tokens=8, sampling=sampling).compile()
  assert list(sampler._programs) == [(4, 32, 2, 8, sampling)]  # pylint: disable=protected-access
  assert sampler.num_compiles == 1 and compiled.memory_analysis().temp_size_in_bytes > 0

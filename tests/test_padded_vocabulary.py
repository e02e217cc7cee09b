"""GRPO with `vocab_size` padded past the tokenizer (1024 embedding rows over the bundled 512-piece tokenizer), as
MaxText configs and real checkpoints pad it: from random weights the policy prefers padding ids, which the reward's
decode cannot take. The sampler never draws them, and the trainer scores the same masked distribution."""

import jax
import numpy as np
from flax import nnx
from flax.linen import partitioning as nn_partitioning
from scipy import special

from maxtext_posttrain import trainer
from maxtext_posttrain.objectives import rl_base

NUM_PIECES = 512  # the bundled sentencepiece tokenizer's
TINY = ("per_device_batch_size=2", "rl.num_generations=4", "max_target_length=80", "enable_checkpointing=false")
CHARACTERS = ('rl.rewards=["tests.rewards_for_tests:characters"]', "rl.reward_weights=[1.0]")


def test_grpo_over_a_padded_vocabulary_samples_decodable_ids_and_keeps_the_ratio_at_one(make_config):
  config = make_config(
      *TINY, *CHARACTERS, "vocab_size=1024", "decode_sampling_temperature=0.7", "eval_interval=0",
      config_file="grpo.yml",
  )  # fmt: skip
  loop = trainer.setup(config)
  assert loop.objective.num_pieces == NUM_PIECES
  batch = loop.objective.before_step(loop, loop.train_batches.load_next_batch())  # samples, decodes, rewards
  mask = np.asarray(batch["completion_mask"]) != 0
  sampled = np.asarray(batch["targets"])[mask]
  assert sampled.size >= 8 and sampled.max() < NUM_PIECES
  model = lambda state: nnx.merge(loop.primary.graphdef, state).model

  def score(state, b):
    """The trainer's log-probs of the targets over the decodable ids, its tempered logits, and the unmasked ones."""
    logps, logits = rl_base.token_logps(model(state), b, 0.7, NUM_PIECES)
    return logps, logits, rl_base.token_logps(model(state), b, 0.7)[1]

  with jax.set_mesh(loop.mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
    logps, logits, unmasked = jax.device_get(jax.jit(score)(loop.primary.state, batch))
    out = jax.jit(lambda state, b: loop.objective.loss(model(state), b, False))(loop.primary.state, batch)
  assert (unmasked.argmax(-1)[mask] >= NUM_PIECES).mean() > 0.25, "too few padding ids preferred to test the mask"
  difference = np.abs(np.asarray(logps) - np.asarray(batch["old_logps"]))[mask]
  assert difference.max() < 1e-4, difference.max()
  np.testing.assert_allclose(float(out.metrics["ratio_mean"] / out.weight), 1.0, rtol=1e-5)
  # The logged entropy is that of the distribution sampled from, over the 512 decodable ids (a mean per completion).
  entropy = lambda x: np.mean([special.entr(special.softmax(x[i][m], -1)).sum(-1).mean() for i, m in enumerate(mask)])
  assert abs(entropy(unmasked) - entropy(logits)) > 0.1
  np.testing.assert_allclose(float(out.metrics["entropy"] / out.weight), entropy(logits), rtol=1e-4)

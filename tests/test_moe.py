"""Mixture-of-experts models: MaxText's load-balance loss in every trained role's loss (`load_balance`)."""

import jax
import numpy as np
import pytest
from flax import nnx

from maxtext.trainers.pre_train import train as pretrain
from maxtext.utils import gradient_accumulation
from maxtext.utils import sharding
from maxtext_posttrain import config as config_lib
from maxtext_posttrain import load_balance
from maxtext_posttrain import roles
from maxtext_posttrain import trained_model
from maxtext_posttrain import trainer
from tests import run_utils

# A tiny Mixtral-style model: 4 experts, 2 per token, MaxText's dense (CPU) expert path, the router's auxiliary loss
# weighted 0.01 as the Switch Transformer does.
MOE = (
    "decoder_block=mixtral",
    "num_experts=4",
    "num_experts_per_tok=2",
    "base_moe_mlp_dim=512",
    "megablox=false",
    "sparse_matmul=false",
    "load_balance_loss_weight=0.01",
)
RL = ("per_device_batch_size=2", "rl.num_generations=4", "max_target_length=80")
CHARACTERS = ('rl.rewards=["tests.rewards_for_tests:characters"]', "rl.reward_weights=[1.0]")


def test_the_sft_loss_of_an_moe_model_is_maxtexts_pretraining_loss_with_its_load_balance_term(make_config):
  """On one SFT batch, the loss the train step differentiates is MaxText's pretraining `loss_fn` on the same model
  and batch (cross entropy on the completion tokens plus the mean of the layers' load-balance losses), value and
  gradient, every parameter; without the term the router's gradient differs. In evaluation, as in MaxText's
  `eval_step`, the term is logged beside the loss, not added to it."""
  config = make_config(*MOE, "enable_checkpointing=false")
  loop = trainer.setup(config)
  batch = loop.train_batches.load_next_batch()
  graphdef, params, rest = nnx.split(loop.policy(), nnx.Param, ...)
  objective_loss = loop.objective.loss
  ours_fn = load_balance.with_load_balance_loss(objective_loss, config)

  def ours(params, loss_fn=ours_fn):
    out = loss_fn(nnx.merge(graphdef, params, rest, copy=True), batch, True, {})
    return out.total / out.weight, out.metrics.get(load_balance.METRIC, 0.0) / out.weight

  def maxtexts(params):
    loss, aux = pretrain.loss_fn(nnx.merge(graphdef, params, rest, copy=True), config, batch, None, None, is_train=True)
    return loss, aux["moe_lb_loss"]

  (loss, term), grads = jax.value_and_grad(ours, has_aux=True)(params)
  (want_loss, want_term), want_grads = jax.value_and_grad(maxtexts, has_aux=True)(params)
  assert float(want_term) > 0.005  # about the weight: the term is 1 x weight for a perfectly balanced router
  np.testing.assert_allclose(float(term), float(want_term), rtol=1e-5)
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), grads, want_grads)
  (_, term_free), grads_without = jax.value_and_grad(lambda p: ours(p, objective_loss), has_aux=True)(params)
  assert term_free == 0.0
  gate = lambda g: np.asarray(g["decoder"]["layers"]["MoeBlock_0"]["gate"]["kernel"])  # noqa: E731
  assert np.abs(gate(grads) - gate(grads_without)).max() > 1e-4 * np.abs(gate(grads)).max()
  evaluated = ours_fn(loop.policy(), batch, False, {})
  _, aux = pretrain.loss_fn(loop.policy(), config, batch, None, None, is_train=False)
  np.testing.assert_allclose(float(evaluated.total), float(aux["xent_sum"]), rtol=1e-5)
  np.testing.assert_allclose(float(evaluated.metrics[load_balance.METRIC] / evaluated.weight), float(want_term), 1e-5)


@pytest.mark.parametrize("weight", [0.0, 0.01])
def test_gradient_accumulation_over_an_moe_model_is_maxtexts(make_config, weight):
  """Under gradient_accumulation_steps=2, on MaxText's default (TPU) expert path, sparse_matmul, whose layers sow an
  overflow flag at every call: the step's gradient is MaxText's accumulated gradient of its pretraining `loss_fn`
  (each microbatch's load-balance term weighted by its tokens), with the term or without it (weight 0). The
  accumulation loop is the train step's (`_loss_and_grads`); its state must keep one structure over microbatches."""
  moe = [key for key in MOE if not key.startswith(("sparse_matmul", "load_balance"))]
  config = make_config(*moe, "sparse_matmul=true", f"load_balance_loss_weight={weight}", "per_device_batch_size=2",
                       "gradient_accumulation_steps=2", "enable_checkpointing=false")  # fmt: skip
  loop = trainer.setup(config)
  batch = loop.train_batches.load_next_batch()
  policy = loop.trained[roles.POLICY]
  params_shardings, _ = sharding.maybe_update_params_sharding_with_opt(config, policy.state_mesh_shardings)
  loss_fn = load_balance.with_load_balance_loss(loop.objective.loss, config)
  model = loop.policy()
  _, _, metrics, grads = trained_model._loss_and_grads(  # pylint: disable=protected-access
      loss_fn, config, model, params_shardings, batch, dict, nnx.Param
  )
  want_loss, want_aux, want_grads = gradient_accumulation.gradient_accumulation_loss_and_grad(
      pretrain.loss_fn, config, loop.policy(), None, params_shardings, batch, None
  )
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), grads, want_grads)
  assert (load_balance.METRIC in metrics) == (weight > 0)
  assert np.isfinite(float(want_loss)) and (float(want_aux["moe_lb_loss"]) > 0) == (weight > 0)


@pytest.mark.parametrize(
    "config_file, keys",
    [
        ("sft_lora.yml", ()),
        ("dpo.yml", ("per_device_batch_size=2",)),
        ("ppo.yml", (*RL, *CHARACTERS)),
        ("distill.yml", ()),
    ],
)
def test_every_trained_role_of_an_moe_model_adds_the_term_and_trains(request, make_config, tmp_path, config_file, keys):
  """LoRA SFT (adapters on the attention; the experts frozen), DPO (with its frozen MoE reference), PPO (MoE decoding
  for the rollouts; the critic, an MoE model with a scalar head, trains with its own term) and distillation (an MoE
  student of the dense 2-layer SFT teacher) train 3 steps of a tiny MoE model: finite losses, and every trained role
  logs a load-balance term near its weight. (GRPO's policy step and reference are PPO's policy step and DPO's.)"""
  if config_file == "distill.yml":
    teacher = request.getfixturevalue("sft_checkpoint")
    keys = (f"teacher_overrides.load_parameters_path={teacher}", "teacher_overrides.base_num_decoder_layers=2")
  metrics = tmp_path / "metrics.jsonl"
  config = make_config(*MOE, *keys, "steps=3", "enable_checkpointing=false", f"metrics_file={metrics}",
                       config_file=config_file)  # fmt: skip
  loop = trainer.setup(config)
  trainer.train(loop)
  rows = run_utils.rows(metrics)
  assert sorted(rows) == [0, 1, 2]
  terms = [key for key in rows[0] if key.endswith(load_balance.METRIC)]
  assert len(terms) == (2 if config_file == "ppo.yml" else 1), terms
  for row in rows.values():
    assert np.isfinite(row["learning/loss"])
    for key in terms:  # the mean over the 2 layers of terms near the weight (a sum would be twice as large)
      assert 0.008 < row[key] < 0.016, (key, row[key])


@pytest.mark.parametrize(
    "keys, message",
    [
        # DeepSeek's auxiliary-loss-free balancing updates the router's bias after the optimizer step.
        (("model_name=deepseek3-tiny", "routed_bias_update_rate=0.001"), "routed_bias_update_rate > 0"),
        # Layer capture collects what the layers sow, the routers' losses included.
        ((*MOE, "distill_beta=0.5"), "layer-transfer distillation .* of an MoE student"),
    ],
)
def test_moe_features_the_step_does_not_carry_are_refused(make_config, keys, message):
  with pytest.raises(config_lib.ConfigError, match=message):
    trainer.check_supported(make_config(*keys, config_file="distill.yml"))

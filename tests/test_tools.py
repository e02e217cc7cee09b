"""Tools during sampling: the calculator's answers, sampling in turns, the tool's tokens masked out of training and
the sampled ones scored in their whole context."""

import json
import re

import jax
import numpy as np
import pytest
import sentencepiece
from flax import nnx
from flax.linen import partitioning as nn_partitioning

from maxtext_posttrain import config as config_lib
from maxtext_posttrain import sample
from maxtext_posttrain import trainer
from maxtext_posttrain.data import arithmetic
from maxtext_posttrain.data import pipeline
from maxtext_posttrain.objectives import rl_base
from maxtext_posttrain.rollout import SamplingParams
from maxtext_posttrain.rollout import tools
from tests import run_utils
from tests import tools_for_tests

STEP_CALCULATOR = "tests.tools_for_tests:StepCalculator"
# 4 prompts x 4 samples of the 2-layer SFT model, which writes `a op b = c` then `#### c`.
RL = ("per_device_batch_size=4", "rl.num_generations=4", "max_target_length=96", "enable_checkpointing=false")


@pytest.mark.parametrize(
    "text, answer",
    [
        ("Natalia sold 48/2 = <<48/2=", "24>>"),
        ("she earned 12/60 = $<<12/60=", "0.2>>"),
        ("<<0.2*50=", "10>>"),
        ("<<1,000 + 5=", "1005>>"),
        ("<<(3+4)*2-1=", "13>>"),
        ("<<10/3=", "3.333333>>"),
        ("<<-7+2=", "-5>>"),
        ("48/2 = 24 =", None),  # no call open
        ("<<48/2=24>> =", None),  # the last call is closed
        ("<<2**100=", None),  # no powers
        ("<<__import__('os').system('true')=", None),  # parsed, never evaluated as Python
        ("<<1/0=", None),
        ("<<10000000*10000000000=", None),  # past 1e15
        ("<<abc=", None),
    ],
)
def test_the_calculator_answers_gsm8k_annotations_and_nothing_else(text, answer):
  assert tools.Calculator().respond(text) == answer


def test_answers_follow_a_call_as_the_data_tokenizes_them(make_config):
  """In GSM8K's `<<48/2=24>>`, the answer's tokens carry no word-start marker: `answer_ids` gives the tokens the
  call followed by the answer has after the call's own, which is how the training data tokenizes them."""
  config = make_config()
  encoder = pipeline.Encoder.from_config(config)
  piece = sentencepiece.SentencePieceProcessor(model_file=config.tokenizer_path).id_to_piece
  calculator, step = tools.Calculator(), tools_for_tests.StepCalculator()
  assert [piece(i) for i in tools.answer_ids(encoder, calculator, "24>>")] == ["2", "4", ">>"]
  assert [piece(i) for i in encoder.tokenizer.encode("24>>")] == ["▁", "2", "4", ">>"]
  assert piece(tools.stop_id(calculator, encoder)) == "="
  assert piece(tools.stop_id(step, encoder)) == "▁="
  assert [piece(i) for i in tools.answer_ids(encoder, step, " 252")] == ["▁", "2", "5", "2"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("rl.tools=[abacus]",), r"rl.tools: tool 'abacus': expected one of \['calculator'\] or 'package.module:name'"),
        (("rl.tools=[tests.tools_for_tests:nothing]",), "module 'tests.tools_for_tests' has no attribute 'nothing'"),
        (("rl.tools=[tests.run_utils:SHORT_TRAIN_SPLIT]",), "is no tool: it has no name, example_call, respond"),
        ((f"rl.tools=[calculator,{STEP_CALCULATOR},calculator]",), "calculator's calls end with the token calculator's"),
    ],
)
def test_a_tool_that_is_not_one_fails_at_start_naming_it(make_config, overrides, message):
  with pytest.raises(config_lib.ConfigError, match=message):
    trainer.setup(make_config(*RL, *overrides, config_file="grpo.yml"))


def test_on_policy_distillation_refuses_tools(make_config):
  with pytest.raises(config_lib.ConfigError, match="does not use rl.tools"):
    trainer.setup(make_config(f"rl.tools=[{STEP_CALCULATOR}]", config_file="distill_on_policy.yml"))


@pytest.fixture(scope="module")
def tool_loop(tmp_path_factory, tfds_dir, sft_checkpoint):
  """A GRPO run's loop from the SFT model with the step calculator, sampling at temperature 0.7."""
  out = tmp_path_factory.mktemp("tools")
  argv = ["", "grpo.yml", "run_name=tools", f"base_output_directory={out}", f"dataset_path={tfds_dir}"]
  argv += [run_utils.SHORT_TRAIN_SPLIT, *RL, f"rl.tools=[{STEP_CALCULATOR}]", f"load_parameters_path={sft_checkpoint}"]
  argv += ["decode_sampling_temperature=0.7", "eval_interval=0", "rl.grpo_beta=0.04"]
  return trainer.setup(config_lib.initialize(argv))


def test_a_tool_answer_is_spliced_in_masked_out_and_the_rest_scored_in_context(tool_loop):
  """Each completion's step line gets the tool's result; those tokens are context, not loss (completion_mask 0), and the sampler's log-probs of every token the policy sampled, before and after the
  answer, are the trainer's from one forward pass over the whole row: the first iteration's ratio is 1."""
  loop = tool_loop
  config = loop.config
  batch = loop.objective.before_step(loop, loop.train_batches.load_next_batch())
  metrics = loop.objective.step_metrics
  assert metrics["rl/tool_calls_mean"] >= 0.9 and metrics["rl/tool_calls_max"] <= config.rl.max_tool_calls, metrics
  with jax.set_mesh(loop.mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
    logps, _ = jax.jit(lambda state, b: rl_base.token_logps(nnx.merge(loop.primary.graphdef, state).model, b, 0.7))(
        loop.primary.state, batch
    )
  rows = {key: np.asarray(value) for key, value in batch.items()}
  sampled = rows["completion_mask"] != 0
  difference = np.abs(np.asarray(logps) - rows["old_logps"])[sampled]
  assert sampled.sum() >= 100 and difference.max() < 1e-4, difference.max()
  encoder = loop.objective.encoder
  answered = 0
  for row in range(len(rows["targets"])):
    start, end = np.flatnonzero(sampled[row])[0], rows["segmentation"][row].sum()  # the completion's targets
    targets, mask = rows["targets"][row, start:end], sampled[row, start:end]
    holes = np.flatnonzero(mask == 0)
    if not len(holes):
      continue
    answered += 1
    first = holes[: np.argmax(np.diff(holes, append=holes[-1] + 2) > 1) + 1]  # the first answer's tokens
    text = encoder.decode_completion(targets[: first[0]].tolist())
    assert encoder.decode_completion(
        targets[: first[-1] + 1].tolist()
    ) == text + tools_for_tests.StepCalculator().respond(text)
    assert np.all(rows["old_logps"][row, start:end][holes] == 0)
  assert answered >= 8


def test_turns_continue_the_decode_exactly(tool_loop):
  """A tool that never answers: every row stops at its `=` and is decoded again from its re-prefilled context (the
  later turns' program compiles and runs); greedy tokens and log-probs are those of one uninterrupted decode."""
  loop = tool_loop
  encoder = loop.objective.encoder
  prompts = [list(loop.objective.train_prompts.prompt_ids[i]) for i in range(4)]
  greedy = SamplingParams(temperature=0.7)
  turns = tools.ToolUse(loop.sampler(), [tools_for_tests.Silent()], encoder, max_calls=1)
  args = (loop.policy_params(), prompts, 32, encoder.tokenizer.eos_id, jax.random.key(3), greedy)
  plain, in_turns = loop.sampler().sample(*args, num_samples=2), turns.sample(*args, num_samples=2)
  stop = tools.stop_id(tools_for_tests.Silent(), encoder)
  assert all(stop in row[:-1] for row in plain.completions())  # every row is cut into turns
  assert turns.followup.num_compiles >= 1
  assert in_turns.completions() == plain.completions()
  np.testing.assert_allclose(in_turns.logprobs, plain.logprobs, atol=2e-5)
  assert in_turns.sampled.sum() == plain.lengths.sum() and not in_turns.tool_calls.any()


def test_a_tool_that_raises_stops_sampling_or_goes_unanswered_and_counted(tool_loop):
  """rl.tool_on_error=raise (the default): a tool that raises stops sampling with a ToolError naming the tool, the row
  and the completion. skip: its calls go unanswered and are counted per row, and the rows decode on exactly as one
  uninterrupted decode does."""
  loop = tool_loop
  encoder = loop.objective.encoder
  prompts = [list(loop.objective.train_prompts.prompt_ids[i]) for i in range(4)]
  args = (loop.policy_params(), prompts, 32, encoder.tokenizer.eos_id, jax.random.key(3), SamplingParams(temperature=0.7))
  failing = [tools_for_tests.Fails()]
  with pytest.raises(tools.ToolError, match=r"Tool 'fails' on row 0: ValueError: cannot answer '.*'; completion: '"):
    tools.ToolUse(loop.sampler(), failing, encoder, max_calls=1).sample(*args, num_samples=2)
  skipped = tools.ToolUse(loop.sampler(), failing, encoder, max_calls=1, on_error="skip").sample(*args, num_samples=2)
  plain = loop.sampler().sample(*args, num_samples=2)
  assert skipped.completions() == plain.completions()
  assert skipped.tool_errors.tolist() == [1] * 8 and not skipped.tool_calls.any()  # every row stops at a call once


@pytest.mark.parametrize(
    "config_file, overrides",
    [
        ("grpo.yml", ("rl.off_policy_steps=1", "trainer_devices_fraction=1", "sampler_devices_fraction=1")),
        ("ppo.yml", ()),
    ],
)
def test_rl_trains_with_a_tool(make_config, sft_checkpoint, tmp_path, config_file, overrides):
  """GRPO sampling ahead (the first turn dispatched a step early, the later ones with the weights it read) and PPO
  (its critic's GAE steps over the answers) train with the tool: every step's completions call it. Sampling ahead, a
  step finishes its own batch's later turns before it dispatches the next batch's first turn, which would otherwise
  hold them up on the sampler's devices."""
  metrics_file = tmp_path / "metrics.jsonl"
  config = make_config(
      *RL, *overrides, f"rl.tools=[{STEP_CALCULATOR}]", f"load_parameters_path={sft_checkpoint}", "steps=3",
      "eval_interval=0", f"metrics_file={metrics_file}", config_file=config_file,
  )  # fmt: skip
  loop = trainer.setup(config)
  objective, events = loop.objective, []
  dispatch, later_turns = objective._dispatch, objective.sampler(loop).followup  # pylint: disable=protected-access
  sample_later = later_turns.sample

  def first_turn(loop, indices, step, round_index, copy_params=False):
    events.append(("first turn", step))
    return dispatch(loop, indices, step, round_index, copy_params)

  objective._dispatch = first_turn  # pylint: disable=protected-access
  later_turns.sample = lambda *args, **kwargs: events.append(("later turn", None)) or sample_later(*args, **kwargs)
  trainer.train(loop)
  # Each batch's first turn, then its later turns (one or more), before the next batch's first turn.
  collapsed = [event for i, event in enumerate(events) if i == 0 or event != events[i - 1]]
  kinds = [kind for kind, _ in collapsed]
  assert kinds and kinds == ["first turn", "later turn"] * (len(kinds) // 2), kinds
  if overrides:
    assert [step for kind, step in collapsed if kind == "first turn"] == [0, 1, 2]
  rows = run_utils.rows(metrics_file)
  assert sorted(rows) == [0, 1, 2]
  for row in rows.values():
    assert row["rl/tool_calls_mean"] >= 0.9 and row["rl/tool_errors"] == 0 and np.isfinite(row["learning/loss"]), row
  if overrides:
    assert [rows[step]["rl/staleness"] for step in (0, 1, 2)] == [0.0, 1.0, 1.0]


def test_the_sample_command_samples_with_the_tools(tool_loop, capsys):
  """`python -m maxtext_posttrain.sample` with rl.tools: the samples call the tool as rollouts do, and each JSON line
  counts its answered calls."""
  config = tool_loop.config
  prompts = tool_loop.objective.train_prompts
  question = prompts.source[0][prompts.columns[0]]  # as a user types it; the command applies the prompt template
  argv = ["", "grpo.yml", "run_name=tools_sample", f"base_output_directory={config.base_output_directory}"]
  argv += [*RL, f"rl.tools=[{STEP_CALCULATOR}]", f"load_parameters_path={config.load_parameters_path}"]
  sample.main([*argv, f"prompt={question}", "num_samples=2", "seed=1"])
  samples = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
  assert [s["sample"] for s in samples] == [0, 1]
  assert all(s["tool_calls"] >= 1 and s["num_tokens"] > 0 for s in samples), samples


def test_the_calculator_set_is_the_hard_set_annotated_as_the_calculator_answers():
  """`arithmetic_word_problems/hard_calculator`: the hard problems with GSM8K's annotation on every step, each one
  what the calculator answers to the solution up to it."""
  plain = arithmetic.generate("hard", "train", 50, seed=0)
  annotated = arithmetic.generate("hard", "train", 50, seed=0, calculator=True)
  calls = 0
  for before, after in zip(plain, annotated, strict=True):
    assert after["question"] == before["question"]
    assert re.sub(r"<<[^>]*>>", "", after["answer"]) == before["answer"]
    for call in re.finditer(r"<<[^=]*=", after["answer"]):
      calls += 1
      assert after["answer"][call.end() :].startswith(tools.Calculator().respond(after["answer"][: call.end()]))
  assert calls >= 100


def test_a_resumed_run_with_a_tool_repeats_the_uninterrupted_one(make_config, sft_checkpoint, tmp_path):
  """Every turn's sampling key is folded from the step's, and a checkpoint part-way through a rollout batch
  (rl.num_iterations=2, saved after step 2) saves its rows with their mask: a run killed after step 2 and resumed
  logs the uninterrupted run's rewards, calls and losses."""
  common = (*RL, f"rl.tools=[{STEP_CALCULATOR}]", f"load_parameters_path={sft_checkpoint}", "rl.num_iterations=2")
  common += ("enable_checkpointing=true", "checkpoint_period=2", "async_checkpointing=false", "eval_interval=0")

  def run(name, *overrides):
    metrics_file = tmp_path / f"{name}.jsonl"
    run_utils.run(make_config(*common, *overrides, f"metrics_file={metrics_file}", run_name=name, config_file="grpo.yml"))
    return run_utils.rows(metrics_file)

  full = run("full", "steps=4")
  run("split", "steps=3", "save_checkpoint_on_completion=false")  # its last checkpoint is step 2's, mid-batch
  split = run("split", "steps=4")
  assert sorted(split) == sorted(full) == [0, 1, 2, 3]
  for key in ("rl/reward_mean", "rl/tool_calls_mean"):  # logged by the steps that draw a batch
    assert [full[s][key] for s in (0, 2)] == [split[s][key] for s in (0, 2)], key
  assert full[2]["rl/tool_calls_mean"] >= 0.9
  np.testing.assert_allclose(
      [split[s]["learning/loss"] for s in range(4)], [full[s]["learning/loss"] for s in range(4)], rtol=1e-5
  )

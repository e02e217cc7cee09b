"""Tests for maxtext_posttrain.data: generator, TFDS builder, record sources and the SFT pipeline (CPU, seconds)."""

import functools
import json
import os
import sys

import grain.python as grain
import numpy as np
import pytest
import tensorflow_datasets as tfds

from maxtext.utils import maxtext_utils
from maxtext_posttrain.data import arithmetic
from maxtext_posttrain.data import arithmetic_tfds
from maxtext_posttrain.data import pipeline
from maxtext_posttrain.data import prompts
from maxtext_posttrain.data import sources
from maxtext_posttrain.data import split_pass
from maxtext_posttrain.rewards import math as math_rewards
from tests.paths import GSM8K

ROWS = [
    {"question": "Tom has 3 apples and buys 5 more. How many apples does Tom have now?", "answer": "3 + 5 = 8\n#### 8"},
    {"question": "Ana has 9 pens and loses 4. How many pens are left?", "answer": "9 - 4 = 5\n#### 5"},
    {"question": "Bo has 2 cats and gets 2 more. How many cats now?", "answer": "2 + 2 = 4\n#### 4"},
    {"question": "Eli has 7 cards and gives away 1. How many cards now?", "answer": "7 - 1 = 6\n#### 6"},
]


@pytest.fixture
def small_config(make_config):
  """A tiny SFT config from sft.yml with a 2-row batch, for pipeline tests."""
  return functools.partial(make_config, "per_device_batch_size=2")


def write_jsonl(path, rows):
  path.write_text("".join(json.dumps(row) + "\n" for row in rows))
  return str(path)


def jsonl_config(small_config, tmp_path, rows=ROWS, *overrides):
  train = write_jsonl(tmp_path / "train.jsonl", rows)
  return small_config("grain_file_type=jsonl", f"grain_train_files={train}", f"grain_eval_files={train}", *overrides)


def test_generator_is_deterministic_and_splits_are_disjoint():
  for difficulty in arithmetic.DIFFICULTIES:
    train = arithmetic.generate(difficulty, "train", 2000, seed=0)
    assert train == arithmetic.generate(difficulty, "train", 2000, seed=0)
    assert train != arithmetic.generate(difficulty, "train", 2000, seed=1)
    test = arithmetic.generate(difficulty, "test", 200, seed=0)
    questions = [example["question"] for example in train]
    assert len(set(questions)) == len(questions)
    assert not set(questions) & {example["question"] for example in test}
    for example in train[:50]:
      *steps, final = example["answer"].split("\n")
      assert final == f"#### {steps[-1].split(' = ')[1]}"
      for step in steps:
        expression, result = step.split(" = ")
        assert eval(expression) == int(result) >= 0  # pylint: disable=eval-used


def test_tfds_builder_builds_offline_and_reads_through_grain(tmp_path):
  config = arithmetic_tfds.ArithmeticConfig(name="tiny", num_train=40, num_test=8)
  builder = arithmetic_tfds.ArithmeticWordProblems(config=config, data_dir=str(tmp_path), file_format="array_record")
  builder.download_and_prepare()
  source = tfds.data_source("arithmetic_word_problems/tiny", data_dir=str(tmp_path), split="test")
  rows = list(grain.MapDataset.source(source))
  assert len(rows) == 8
  assert {row["question"].decode() for row in rows} == {e["question"] for e in arithmetic.generate("easy", "test", 8, 0)}
  assert "tensorflow" not in sys.modules


def test_tfds_source_is_built_on_first_use(tmp_path, tfds_dir, small_config):
  config = small_config("eval_interval=1")
  examples, stats = pipeline.prepare_split(config, train=False)
  assert stats.num_examples == len(examples) == 500
  assert stats.source == f"tfds:arithmetic_word_problems/easy[test] in {tfds_dir}"


def test_tfds_splits_slice_and_fail_as_tfds_reads_them(tfds_dir, small_config):
  """train_split/eval_split take TFDS's split syntax, as MaxText's TFDS pipeline passes them to TFDS."""
  whole = sources.open_source(small_config(), train=True)
  head = sources.open_source(small_config("train_split=train[:300]"), train=True)
  assert len(head) == 300 and head[299] == whole[299]
  assert head.description == f"tfds:arithmetic_word_problems/easy[train[:300]] in {tfds_dir}"
  _, stats = pipeline.prepare_split(small_config("eval_interval=1", "eval_split=test[10%:20%]"), train=False)
  assert stats.num_examples == 50
  with pytest.raises(
      ValueError, match=r"easy\[trian\] in .*: Unknown split 'trian'. Should be one of \['train', 'test'\]"
  ):
    sources.open_source(small_config("train_split=trian"), train=True)
  with pytest.raises(ValueError, match=r"easy\[train\[:x\]\] in .*: Error parsing split 'train\[:x\]'.*[^\n]$"):
    sources.open_source(small_config("train_split=train[:x]"), train=True)


def test_a_block_read_returns_the_records_one_read_at_a_time_would(tmp_path, small_config):
  """The setup pass reads records a block at a time (`RecordSource.read`), across JSONL files too."""
  first, second = write_jsonl(tmp_path / "a.jsonl", ROWS[:3]), write_jsonl(tmp_path / "b.jsonl", ROWS[3:] + ROWS[:1])
  for config in (small_config(), small_config("grain_file_type=jsonl", f"grain_train_files={first},{second}")):
    source = sources.open_source(config, train=True)
    indices = range(1, 5)
    assert source.read(indices) == [source[index] for index in indices]


def test_jsonl_malformed_line_names_file_and_line(tmp_path, small_config):
  path = tmp_path / "bad.jsonl"
  path.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
  config = small_config("grain_file_type=jsonl", f"grain_train_files={path}")
  with pytest.raises(ValueError, match=f"{path}:2: malformed JSON"):
    pipeline.prepare_split(config, train=True)


def test_a_bad_line_in_a_later_block_is_named_and_counts_are_kept_in_order(tmp_path, small_config, monkeypatch):
  """Blocks of 2 records: the same counts and fingerprint as one block, and a bad line in the third block is named."""
  config = jsonl_config(small_config, tmp_path, ROWS)
  _, stats = pipeline.prepare_split(config, train=True)
  monkeypatch.setattr(split_pass, "READ_SIZE", 2)
  assert pipeline.prepare_split(config, train=True)[1] == stats
  path = tmp_path / "train.jsonl"
  path.write_text(path.read_text() + "{not json\n" + json.dumps(ROWS[0]) + "\n")
  with pytest.raises(ValueError, match=f"{path}:5: malformed JSON"):
    pipeline.prepare_split(config, train=True)


def test_jsonl_missing_field_names_field_file_and_line(tmp_path, small_config):
  config = jsonl_config(small_config, tmp_path, ROWS[:2] + [{"question": "q"}])
  with pytest.raises(ValueError, match=r"train.jsonl:3: missing field 'answer'"):
    pipeline.prepare_split(config, train=True)


def test_empty_dataset_and_unknown_file_type(tmp_path, small_config):
  with pytest.raises(ValueError, match="Empty dataset: jsonl:.*train.jsonl"):
    pipeline.prepare_split(jsonl_config(small_config, tmp_path, []), train=True)
  with pytest.raises(ValueError, match="supported: tfds, jsonl"):
    pipeline.prepare_split(small_config("grain_file_type=parquet"), train=True)


def long_rows():
  return ROWS[:2] + [
      {"question": "How much is this?", "answer": " ".join(["1 + 1 = 2"] * 20) + "\n#### 2"},  # long completion
      {"question": "Long question " * 40, "answer": "#### 1"},  # prompt alone fills the window
  ]


def test_overlong_examples_are_truncated_or_skipped_and_counted(tmp_path, small_config):
  config = jsonl_config(small_config, tmp_path, long_rows(), "max_target_length=64")
  examples, stats = pipeline.prepare_split(config, train=True)
  assert (stats.num_examples, stats.num_truncated, stats.num_skipped, len(examples)) == (4, 1, 1, 3)
  assert max(len(examples[i]["inputs"]) for i in range(3)) == 64
  assert stats.num_tokens == sum(len(examples[i]["inputs"]) for i in range(3))


def test_overlong_error_policy_names_split_and_index(tmp_path, small_config):
  config = jsonl_config(small_config, tmp_path, long_rows(), "max_target_length=64", "overlong_policy=error")
  with pytest.raises(ValueError, match="train example 2 of jsonl:"):
    pipeline.prepare_split(config, train=True)


def test_completion_only_masking(tmp_path, small_config):
  config = jsonl_config(small_config, tmp_path, ROWS, "packing=false", "enable_data_shuffling=false")
  mesh = maxtext_utils.get_mesh_from_config(config)
  train, _, _ = pipeline.make_sft_iterators(config, mesh)
  batch = {k: np.asarray(v) for k, v in next(train).items()}
  encoder = pipeline.Encoder.from_config(config)
  for row, example in enumerate(ROWS[:2]):
    prompt = encoder.prompt_ids(example["question"])
    completion = encoder.completion_ids(example["answer"])
    length = len(prompt) + len(completion)
    np.testing.assert_array_equal(batch["inputs"][row, :length], prompt + completion)
    expected = np.zeros(config.max_target_length, np.int32)
    expected[len(prompt) - 1 : length - 1] = 1  # position i predicts token i + 1: exactly the completion tokens
    np.testing.assert_array_equal(batch["targets_segmentation"][row], expected)
    np.testing.assert_array_equal(batch["targets"][row, len(prompt) - 1 : length - 1], completion)


def test_packed_batches_restart_positions_per_segment(tmp_path, small_config):
  config = jsonl_config(small_config, tmp_path, ROWS, "packing=true")
  mesh = maxtext_utils.get_mesh_from_config(config)
  train, _, _ = pipeline.make_sft_iterators(config, mesh)
  batch = {k: np.asarray(v) for k, v in next(train).items()}
  segments, positions = batch["inputs_segmentation"][0], batch["inputs_position"][0]
  assert segments.max() >= 2  # several short examples share a row
  for segment in range(1, segments.max() + 1):
    np.testing.assert_array_equal(positions[segments == segment], np.arange(np.sum(segments == segment)))
  assert set(np.unique(batch["targets_segmentation"])) <= set(np.unique(segments))


def test_fingerprint_is_stable_and_tracks_the_data(tmp_path, tfds_dir, small_config):
  config = small_config("eval_interval=1")
  _, eval_stats = pipeline.prepare_split(config, train=False)
  assert pipeline.prepare_split(config, train=False)[1] == eval_stats
  _, train_stats = pipeline.prepare_split(jsonl_config(small_config, tmp_path), train=True)
  _, other_stats = pipeline.prepare_split(jsonl_config(small_config, tmp_path, ROWS[::-1]), train=True)
  assert len({eval_stats.fingerprint, train_stats.fingerprint, other_stats.fingerprint}) == 3
  assert pipeline.DataStats(train=train_stats, eval=eval_stats).to_dict()["eval"]["num_examples"] == 500


def test_train_iterator_resumes_in_the_same_order_and_eval_repeats(tmp_path, small_config):
  config = jsonl_config(small_config, tmp_path, ROWS * 5, "eval_interval=1")
  mesh = maxtext_utils.get_mesh_from_config(config)
  train, evaluation, _ = pipeline.make_sft_iterators(config, mesh)
  for _ in range(3):
    next(train)
  state = train.local_iterator.get_state()
  expected = [np.asarray(next(train)["inputs"]) for _ in range(3)]
  resumed, _, _ = pipeline.make_sft_iterators(config, mesh)
  resumed.local_iterator.set_state(state)
  for batch in expected:
    np.testing.assert_array_equal(np.asarray(next(resumed)["inputs"]), batch)
  first = [np.asarray(batch["inputs"]) for batch in evaluation]
  second = [np.asarray(batch["inputs"]) for batch in evaluation]
  assert first and all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))


def test_prompt_sets_keep_source_order_template_and_answers(tmp_path, small_config):
  config = jsonl_config(small_config, tmp_path)
  prompt_set = prompts.load(config, train=False, limit=2)
  assert list(prompt_set.answers) == [r["answer"] for r in ROWS[:2]]
  assert prompt_set.prompt_texts[0] == config.prompt_template.format(prompt=ROWS[0]["question"])
  assert list(prompt_set.prompt_ids[0]) == pipeline.Encoder.from_config(config).prompt_ids(ROWS[0]["question"])
  assert prompt_set[1] == {prompts.INDEX_KEY: 1} and len(prompt_set) == 2
  assert prompts.load(config, train=False, limit=2).fingerprint == prompt_set.fingerprint


def test_gsm8k_jsonl(tmp_path, small_config):
  config = small_config("grain_file_type=jsonl", f"grain_train_files={GSM8K}/train.jsonl")
  _, stats = pipeline.prepare_split(config, train=True)
  assert stats.num_examples == 7473
  with open(os.path.join(GSM8K, "test.jsonl"), encoding="utf-8") as f:
    answers = [math_rewards.gold_answer(json.loads(line)["answer"]) for line in f]
  assert len(answers) == 1319 and all(math_rewards.parse_number(answer) is not None for answer in answers)

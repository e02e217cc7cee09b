"""Offline distillation: score_teacher writes the teacher's top-k files, and posttrain_mode=distill reading them trains
as the same run with the teacher online does; files scored for other data, k, temperature or tokenizer are refused."""

import dataclasses
import json
import os

import numpy as np
import pytest

from maxtext_posttrain import config as posttrain_config
from maxtext_posttrain import score_teacher
from maxtext_posttrain import trainer
from maxtext_posttrain.data import arithmetic
from maxtext_posttrain.data import pipeline
from maxtext_posttrain.data import teacher_logits
from tests import run_utils

TOP_K = 8


def _write_jsonl(path, split, count, seed=0):
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(problem) + "\n" for problem in arithmetic.generate("easy", split, count, seed=seed))
  return path


def _argv(out, name, teacher, *extra):
  argv = ["", "distill.yml", f"run_name={name}", f"base_output_directory={out}", "grain_file_type=jsonl"]
  argv += [f"grain_train_files={out / 'train.jsonl'}", f"grain_eval_files={out / 'test.jsonl'}", "steps=6"]
  argv += ["eval_interval=3", "eval_steps=1", "eval_generation_examples=0", "enable_checkpointing=false"]
  argv += [f"distill.top_k={TOP_K}", f"teacher_overrides.load_parameters_path={teacher}", "log_period=1"]
  return argv + list(extra)


@pytest.fixture(scope="module")
def scored(tmp_path_factory, deep_sft_checkpoint):
  """(directory of the 4-layer teacher's top-8 files over 96 training and 32 held-out problems, its metadata,
  the argv builder)."""
  out = tmp_path_factory.mktemp("offline")
  _write_jsonl(out / "train.jsonl", "train", 96)
  _write_jsonl(out / "test.jsonl", "test", 32)
  logits = out / "logits"
  config = posttrain_config.initialize(_argv(out, "score", deep_sft_checkpoint, f"offline_data_dir={logits}"))
  metadata = score_teacher.score(config)
  return out, logits, metadata, lambda name, *extra: _argv(out, name, deep_sft_checkpoint, *extra)


def test_score_teacher_writes_one_record_per_example_with_its_size(scored):
  _, logits, metadata, _ = scored
  assert metadata.top_k == TOP_K and sorted(metadata.splits) == ["eval", "train"]
  for split, count in (("train", 96), ("eval", 32)):
    entry = metadata.splits[split]
    assert entry["num_examples"] == count
    assert entry["bytes"] == os.path.getsize(teacher_logits.split_file(logits, split))
    assert metadata.bytes_per_token(split) == entry["bytes"] / entry["num_scored_tokens"] > 0
  assert teacher_logits.Metadata.read(logits) == metadata


def test_records_are_the_teachers_top_k_at_the_positions_a_packed_batch_trains_on(scored):
  out, logits, _, argv = scored
  config = posttrain_config.initialize(argv("read", f"offline_data_dir={logits}"))
  examples, stats = pipeline.prepare_split(config, True)
  source = teacher_logits.with_teacher(config, examples, "train", stats)
  pad_id = pipeline.Encoder.from_config(config).pad_id
  for index in (0, 17, 95):
    row = source[index]
    inputs, targets = row["inputs"], row["targets"]
    scored_at = teacher_logits.scored_positions(inputs, targets, pad_id)
    assert scored_at[-1] == len(inputs) - 1
    assert set(np.flatnonzero(targets[1:] != pad_id)) <= set(scored_at)
    probs = np.exp(row["teacher_logprobs"][scored_at])
    np.testing.assert_allclose(probs.sum(-1) + np.exp(row["teacher_log_rest"][scored_at]), 1.0, rtol=1e-5)
    assert np.all(np.diff(row["teacher_logprobs"][scored_at], axis=-1) <= 0)  # most likely first
    assert all(len(set(ids)) == TOP_K for ids in row["teacher_ids"][scored_at])


def test_offline_training_repeats_the_online_top_k_run(scored):
  """Same student, data order and k: the loss read from the files equals the loss with the teacher in the step."""
  out, logits, _, argv = scored
  rows = {}
  for name, extra in (("online", ()), ("offline", (f"offline_data_dir={logits}",))):
    config = posttrain_config.initialize(argv(name, f"metrics_file={out / name}.jsonl", *extra))
    loop = trainer.setup(config)
    assert ("teacher" in loop.frozen) == (name == "online")  # offline: no teacher model is built
    trainer.train(loop)
    rows[name] = run_utils.rows(out / f"{name}.jsonl")
  for step in range(6):
    for key in ("learning/loss", "learning/divergence", "learning/ce"):
      np.testing.assert_allclose(rows["offline"][step][key], rows["online"][step][key], rtol=2e-5, err_msg=key)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"top_k": 4}, "top 4 tokens; the run asks for distill.top_k=8"),
        ({"vocab_size": 1024}, "vocab_size=1024"),
        ({"tokenizer_digest": "0" * 64}, "is a different file"),
        ({"temperature": 2.0}, "temperature 2.0"),
        ({"splits": {}}, "has no train split"),
    ],
)
def test_files_scored_for_another_run_are_refused_by_name(scored, change, message):
  _, logits, metadata, argv = scored
  config = posttrain_config.initialize(argv("check", f"offline_data_dir={logits}"))
  examples, stats = pipeline.prepare_split(config, True)
  with pytest.raises(ValueError, match=message):
    teacher_logits.check_against(dataclasses.replace(metadata, **change), config, "train", stats, str(logits))


def test_files_of_another_dataset_are_refused_at_start(scored):
  out, logits, _, argv = scored
  other = _write_jsonl(out / "other.jsonl", "train", 96, seed=1)
  config = posttrain_config.initialize(argv("other", f"offline_data_dir={logits}", f"grain_train_files={other}"))
  with pytest.raises(ValueError, match=r"the train split's tokens differ from the ones the teacher scored"):
    trainer.setup(config)


def test_offline_files_need_their_metadata_and_serve_distill_only(scored, tmp_path):
  _, logits, _, argv = scored
  with pytest.raises(ValueError, match="has no teacher_top_k.json"):
    trainer.setup(posttrain_config.initialize(argv("missing", f"offline_data_dir={tmp_path}")))
  with pytest.raises(ValueError, match="a temperature schedule needs the online teacher"):
    score_teacher.score(
        posttrain_config.initialize(argv("t", f"offline_data_dir={tmp_path}", "distill_temperature_end=2"))
    )

"""Distillation step time against MaxText's pretraining step of the student on the same tokens, model and mesh, with
the FLOP prediction: dense, with the teacher's top-k, and offline (the top-k read from files the teacher wrote).

A distillation step (`posttrain_mode=distill`) is one jitted program: the frozen teacher's forward over the batch, read
inside the step, then the student's forward and backward and a loss over the vocabulary. Counting a forward as one
third of a forward+backward, FLOPs predict distillation / pretraining = 1 + teacher forward / student training =
1 + teacher / (3 x student), each MaxText's `calculate_tflops_training_per_device` of its own config. The loss's
work over the vocabulary is not in that count; `distill.top_k` changes it (the teacher kept as its k most likely
tokens plus their remaining mass), so the same step is also timed with `distill.top_k=--top_k`, by a second loop.
Offline distillation (`offline_data_dir`) reads those top-k columns with the batch and builds no teacher: its step is
the student's training plus the same sparse loss, predicted 1 (MaxText's `calculate_distillation_tflops_per_device`
with `is_offline=True` counts no teacher FLOPs). A third loop times it on files `score_teacher.score` writes with the
same teacher, after which the data's cost is on disk: `offline_bytes_per_token`, the metadata's file bytes per scored
token (records of about 8k + 8 bytes a token, compressed by ArrayRecord into 64 KiB blocks, 128 KiB at least: a
share of the figure on a split this small).

The student is the benchmark model; the teacher is, as the loop builds it, the yml plus `teacher_overrides` without
the command line's keys, which are the student's. The benchmark sets `teacher_overrides` to the benchmark model's keys
(with the command line's values where it sets them) and twice the student's decoder layers; `teacher_overrides.<key>`
on the command line overrides them. The loop refuses a teacher without `teacher_overrides.load_parameters_path`;
without one the benchmark writes the teacher's seeded initialisation as a params-only checkpoint (removed at exit)
and reads that, since the step's time does not depend on the weights' values.

The data is a JSONL file of the bundled arithmetic problems that the benchmark writes, a little more than a batch,
since scoring reads the whole train split and only one batch is timed (`grain_train_files=` on the command line
names other data, which is then scored whole). The loops' jitted steps and MaxText's pretraining step
(`train_utils.jit_train_step`, the same state shardings and donation) run alternately in one process on one SFT batch
(a packed batch is a valid pretraining batch); the offline loop's first batch, drawn by the same pipeline from the
same examples, is the same rows plus the teacher's columns, which the benchmark checks. Prints and writes JSON rows
`{objective, step_time_s, pretrain_step_time_s, ratio, flops_prediction, ratio_to_prediction, top_k,
top_k_step_time_s, top_k_ratio, top_k_vs_dense, offline_step_time_s, offline_ratio, offline_vs_online_top_k,
offline_flops_prediction, offline_bytes_per_token, student_tflops, teacher_tflops, teacher_parameters}`.

  python -m benchmarks.distill_vs_pretrain [distill.yml] [key=value ...] [--repeats=N] [--top_k=K] \
      [--output=path.json]
"""

import atexit
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import partitioning as nn_partitioning

from benchmarks import harness
from maxtext.common import checkpointing
from maxtext.utils import maxtext_utils
from maxtext.utils import model_creation_utils
from maxtext_posttrain import config as config_lib
from maxtext_posttrain import roles
from maxtext_posttrain import score_teacher
from maxtext_posttrain import trainer
from maxtext_posttrain.data import arithmetic


def teacher_keys(args: harness.Args) -> list[str]:
  """`teacher_overrides` keys making the teacher the benchmark model (the command line's values where it sets its
  keys) with twice the student's decoder layers; the command line's own `teacher_overrides.*` come after them."""
  names = {key.split("=", 1)[0] for key in harness.BENCHMARK_MODEL}
  model = dict(key.split("=", 1) for key in (*harness.BENCHMARK_MODEL, *args.overrides) if key.split("=", 1)[0] in names)
  model["base_num_decoder_layers"] = str(2 * int(model["base_num_decoder_layers"]))
  return [f"teacher_overrides.{name}={value}" for name, value in model.items()]


def seeded_teacher_checkpoint(config) -> str:
  """Writes the seeded initialisation of `config`'s teacher (the yml plus `teacher_overrides`) as a params-only
  checkpoint in a directory removed at exit; returns its `load_parameters_path`."""
  teacher = config_lib.reinitialize(config, command_line=False, **config.teacher_overrides)
  model = model_creation_utils.from_pretrained(teacher, maxtext_utils.get_mesh_from_config(teacher))
  directory = tempfile.mkdtemp(prefix="posttrain_bench_teacher_")
  atexit.register(shutil.rmtree, directory, ignore_errors=True)
  checkpointing.save_params_to_path(
      directory,
      {"params": nnx.state(model, nnx.Param).to_pure_dict()},
      teacher.checkpoint_storage_use_ocdbt,
      teacher.checkpoint_storage_use_zarr3,
  )
  return f"{directory}/items"


def write_problems(path: str, config) -> None:
  """Writes easy arithmetic problems (MaxText's SFT columns, question and answer) to `path` as JSONL: one per 32 of a
  packed batch's tokens, more than the batch holds (about 51 tokens each), so that its rows repeat no problem."""
  count = config.global_batch_size_to_train_on * config.max_target_length // 32
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(problem) + "\n" for problem in arithmetic.generate("easy", "train", count, seed=0))


def training_tflops(config) -> float:
  """MaxText's TFLOPs of one training step (forward and backward) per device."""
  return maxtext_utils.calculate_tflops_training_per_device(config, log=False)[0]


def _timed(step_fn, state, *args):
  start = time.perf_counter()
  state, metrics = step_fn(state, *args)
  jax.block_until_ready((state, metrics))
  return state, time.perf_counter() - start


def main(argv):
  args = harness.parse(argv, default_config="distill.yml")
  repeats = int(args.flag("repeats", "10"))
  top_k = int(args.flag("top_k", "64"))
  output = args.flag("output", "benchmark_distill_vs_pretrain.json")
  data = tempfile.mkdtemp(prefix="posttrain_bench_distill_data_")
  atexit.register(shutil.rmtree, data, ignore_errors=True)
  problems = os.path.join(data, "train.jsonl")
  config = args.config("distill", "grain_file_type=jsonl", f"grain_train_files={problems}", *teacher_keys(args))
  write_problems(problems, config)
  if not config.teacher_overrides.get("load_parameters_path"):
    checkpoint = seeded_teacher_checkpoint(config)
    config = config_lib.with_overrides(
        config, teacher_overrides=config.teacher_overrides | {"load_parameters_path": checkpoint}
    )
  section = config_lib.distill(config)
  loop = trainer.setup(config)
  sparse_config = config_lib.with_overrides(config, distill=section.model_copy(update={"top_k": top_k}))
  sparse_loop = trainer.setup(sparse_config)
  offline_config = config_lib.with_overrides(sparse_config, offline_data_dir=os.path.join(data, "teacher_top_k"))
  metadata = score_teacher.score(offline_config)
  offline_loop = trainer.setup(offline_config)
  p_pretrain_step = harness.jit_pretraining_step(loop)
  pretrain_batch = loop.train_batches.load_next_batch()
  batch = loop.objective.before_step(loop, pretrain_batch)  # plus the schedules' values at the step
  offline_batch = offline_loop.objective.before_step(offline_loop, offline_loop.train_batches.load_next_batch())
  if not all(jnp.array_equal(offline_batch[key], tokens) for key, tokens in pretrain_batch.items()):
    raise ValueError("The offline loop's first batch holds other token rows than the online loops' first batch.")
  state, sparse_state, offline_state = loop.primary.state, sparse_loop.primary.state, offline_loop.primary.state
  frozen, sparse_frozen, offline_frozen = loop.frozen_states(), sparse_loop.frozen_states(), offline_loop.frozen_states()
  times = {"distill": [], "top_k": [], "offline": [], "pretrain": []}
  with jax.set_mesh(loop.mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
    for repeat in range(-2, repeats):  # two warm-up rounds compile every program
      seconds = {}
      state, seconds["pretrain"] = _timed(p_pretrain_step, state, pretrain_batch)
      state, seconds["distill"] = _timed(loop.primary.p_train_step, state, batch, frozen)
      sparse_state, seconds["top_k"] = _timed(sparse_loop.primary.p_train_step, sparse_state, batch, sparse_frozen)
      offline_state, seconds["offline"] = _timed(
          offline_loop.primary.p_train_step, offline_state, offline_batch, offline_frozen
      )
      if repeat >= 0:
        for name, value in seconds.items():
          times[name].append(value)
  loop.primary.state, sparse_loop.primary.state, offline_loop.primary.state = state, sparse_state, offline_state
  step_s, pretrain_s, top_k_s, offline_s = (
      statistics.median(times[name]) for name in ("distill", "pretrain", "top_k", "offline")
  )
  teacher = loop.frozen[roles.TEACHER]
  student_tflops, teacher_tflops = training_tflops(config), training_tflops(teacher.config)
  prediction = 1 + teacher_tflops / (3 * student_tflops)
  row = {
      "objective": f"distill ({section.divergence}, teacher {teacher.config.num_decoder_layers} layers, "
      f"student {config.num_decoder_layers})",
      "step_time_s": step_s,
      "pretrain_step_time_s": pretrain_s,
      "ratio": step_s / pretrain_s,
      "flops_prediction": prediction,
      "ratio_to_prediction": step_s / pretrain_s / prediction,
      "top_k": top_k,
      "top_k_step_time_s": top_k_s,
      "top_k_ratio": top_k_s / pretrain_s,
      "top_k_vs_dense": top_k_s / step_s,
      "offline_step_time_s": offline_s,
      "offline_ratio": offline_s / pretrain_s,
      "offline_vs_online_top_k": offline_s / top_k_s,
      "offline_flops_prediction": 1.0,  # the student's training FLOPs: no teacher runs
      "offline_bytes_per_token": metadata.bytes_per_token("train"),
      "student_tflops": student_tflops,
      "teacher_tflops": teacher_tflops,
      "teacher_parameters": int(sum(x.size for x in jax.tree.leaves(teacher.state.filter(nnx.Param)))),
  }
  printed = ("objective", "step_time_s", "pretrain_step_time_s", "ratio", "flops_prediction", "ratio_to_prediction")
  printed += ("top_k", "top_k_step_time_s", "top_k_ratio", "top_k_vs_dense", "offline_step_time_s", "offline_ratio")
  printed += ("offline_vs_online_top_k", "offline_flops_prediction", "offline_bytes_per_token", "teacher_parameters")
  harness.write_row(row, loop, repeats, times, output, printed)


if __name__ == "__main__":
  main(sys.argv)

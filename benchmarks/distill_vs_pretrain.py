"""Distillation step time against MaxText's pretraining step of the student on the same tokens, model and mesh, with
the FLOP prediction, dense and with the teacher's top-k.

A distillation step (`posttrain_mode=distill`) is one jitted program: the frozen teacher's forward over the batch, read
inside the step, then the student's forward and backward and a loss over the vocabulary. Counting a forward as one
third of a forward+backward, FLOPs predict distillation / pretraining = 1 + teacher forward / student training =
1 + teacher / (3 x student), each MaxText's `calculate_tflops_training_per_device` of its own config. The loss's
work over the vocabulary is not in that count; `distill.top_k` changes it (the teacher kept as its k most likely
tokens plus their remaining mass), so the same step is also timed with `distill.top_k=--top_k`, by a second loop.

The student is the benchmark model; the teacher is, as the loop builds it, the yml plus `teacher_overrides` without
the command line's keys, which are the student's. The benchmark sets `teacher_overrides` to the benchmark model's keys
(with the command line's values where it sets them) and twice the student's decoder layers; `teacher_overrides.<key>`
on the command line overrides them. The loop refuses a teacher without `teacher_overrides.load_parameters_path`;
without one the benchmark writes the teacher's seeded initialisation as a params-only checkpoint (removed at exit)
and reads that, since the step's time does not depend on the weights' values.

The loop's jitted steps and MaxText's pretraining step (`train_utils.jit_train_step`, the same state shardings and
donation) run alternately in one process on one SFT batch (a packed batch is a valid pretraining batch). Prints and
writes JSON rows `{objective, step_time_s, pretrain_step_time_s, ratio, flops_prediction, ratio_to_prediction, top_k,
top_k_step_time_s, top_k_ratio, top_k_vs_dense, student_tflops, teacher_tflops, teacher_parameters}`.

  python -m benchmarks.distill_vs_pretrain [distill.yml] [key=value ...] [--repeats=N] [--top_k=K] \
      [--output=path.json]
"""

import atexit
import shutil
import statistics
import sys
import tempfile
import time

import jax
from flax import nnx
from flax.linen import partitioning as nn_partitioning

from benchmarks import harness
from maxtext.common import checkpointing
from maxtext.utils import maxtext_utils
from maxtext.utils import model_creation_utils
from maxtext_posttrain import config as config_lib
from maxtext_posttrain import roles
from maxtext_posttrain import trainer


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
  config = args.config("distill", *teacher_keys(args))
  if not config.teacher_overrides.get("load_parameters_path"):
    checkpoint = seeded_teacher_checkpoint(config)
    config = config_lib.with_overrides(
        config, teacher_overrides=config.teacher_overrides | {"load_parameters_path": checkpoint}
    )
  section = config_lib.distill(config)
  loop = trainer.setup(config)
  sparse_loop = trainer.setup(config_lib.with_overrides(config, distill=section.model_copy(update={"top_k": top_k})))
  p_pretrain_step = harness.jit_pretraining_step(loop)
  pretrain_batch = loop.train_batches.load_next_batch()
  batch = loop.objective.before_step(loop, pretrain_batch)  # plus the schedules' values at the step
  state, sparse_state = loop.primary.state, sparse_loop.primary.state
  frozen, sparse_frozen = loop.frozen_states(), sparse_loop.frozen_states()
  times = {"distill": [], "top_k": [], "pretrain": []}
  with jax.set_mesh(loop.mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
    for repeat in range(-2, repeats):  # two warm-up rounds compile every program
      state, pretrain_seconds = _timed(p_pretrain_step, state, pretrain_batch)
      state, distill_seconds = _timed(loop.primary.p_train_step, state, batch, frozen)
      sparse_state, top_k_seconds = _timed(sparse_loop.primary.p_train_step, sparse_state, batch, sparse_frozen)
      if repeat >= 0:
        times["pretrain"].append(pretrain_seconds)
        times["distill"].append(distill_seconds)
        times["top_k"].append(top_k_seconds)
  loop.primary.state, sparse_loop.primary.state = state, sparse_state
  step_s, pretrain_s, top_k_s = (statistics.median(times[name]) for name in ("distill", "pretrain", "top_k"))
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
      "student_tflops": student_tflops,
      "teacher_tflops": teacher_tflops,
      "teacher_parameters": int(sum(x.size for x in jax.tree.leaves(teacher.state.filter(nnx.Param)))),
  }
  printed = ("objective", "step_time_s", "pretrain_step_time_s", "ratio", "flops_prediction", "ratio_to_prediction")
  printed += ("top_k", "top_k_step_time_s", "top_k_ratio", "top_k_vs_dense", "teacher_parameters")
  harness.write_row(row, loop, repeats, times, output, printed)


if __name__ == "__main__":
  main(sys.argv)

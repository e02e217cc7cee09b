"""Prints the first SFT losses for several mesh layouts; run in a subprocess with fake CPU devices.

Weights are initialised alike on every layout without a pipeline (threefry is partitionable). MaxText's pipeline
stores the scanned layers stage-major under `pipeline_module`, and initialises them differently, so a pipelined
layout starts from the first layout's initial weights moved into that layout.

  XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/multidevice_losses.py OUT_DIR TFDS_DIR STEPS \\
      '[["ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"], ...]'

Prints one JSON line per layout: {"overrides": [...], "mesh": {...}, "losses": [...]}.
"""

import json
import sys

import jax
import numpy as np
from flax import nnx
from flax.linen import partitioning as nn_partitioning

from maxtext_posttrain import config as posttrain_config
from maxtext_posttrain import trainer


def _pipeline_layout(params: dict, scan_axis: int) -> dict:
  """Scanned decoder layers [.., layer, ..] -> the pipeline's [stage-major layer, ..] under pipeline_module."""
  decoder = dict(params["decoder"])
  layers = jax.tree.map(lambda x: np.moveaxis(x, scan_axis, 0), decoder.pop("layers"))
  decoder["pipeline_module"] = {"layers": layers}
  return {**params, "decoder": decoder}


def first_losses(out_dir, tfds_dir, steps, overrides, run_name, initial_params=None) -> tuple[dict, dict]:
  config = posttrain_config.initialize(
      ["", "sft.yml", f"run_name={run_name}", f"base_output_directory={out_dir}"]
      + [f"dataset_path={tfds_dir}", "enable_checkpointing=false", "eval_interval=0", f"steps={steps}", *overrides]
  )
  loop = trainer.setup(config)
  if initial_params is None:
    initial_params = jax.device_get(loop.primary.state.model.filter(nnx.Param).to_pure_dict())
  elif config.using_pipeline_parallelism:
    target = loop.primary.state.model.filter(nnx.Param)
    moved = _pipeline_layout(initial_params, config.param_scan_axis)
    target.replace_by_pure_dict(jax.tree.map(lambda x, t: jax.device_put(x, t.sharding), moved, target.to_pure_dict()))
    nnx.update(loop.primary.state.model, target)
  losses = []
  with jax.set_mesh(loop.mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
    for _ in range(steps):
      loop.primary.state, metrics = loop.primary.p_train_step(
          loop.primary.state, loop.train_batches.load_next_batch(), {}
      )
      losses.append(float(metrics["scalar"]["learning/loss"]))
  return {"overrides": overrides, "mesh": dict(loop.mesh.shape), "losses": losses}, initial_params


def main(argv):
  out_dir, tfds_dir, steps, layouts = argv[1], argv[2], int(argv[3]), json.loads(argv[4])
  initial_params = None
  for index, overrides in enumerate(layouts):
    result, initial_params = first_losses(out_dir, tfds_dir, steps, overrides, f"layout{index}", initial_params)
    assert np.all(np.isfinite(result["losses"]))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
  main(sys.argv)

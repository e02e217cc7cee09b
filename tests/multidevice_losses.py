"""The first SFT losses for several mesh layouts; run with fake CPU devices by tests/on_four_devices.py.

Weights are initialised alike on every layout without a pipeline (threefry is partitionable). MaxText's pipeline
stores the scanned layers stage-major under `pipeline_module`, and initialises them differently, so a pipelined
layout starts from the first layout's initial weights moved into that layout.
"""

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


def layouts_losses(out_dir: str, tfds_dir: str, steps: int, layouts: list[list[str]]) -> list[dict]:
  """Per layout: {"overrides": [...], "mesh": {...}, "losses": [...]}; a pipelined layout starts from the first
  layout's initial weights."""
  results, initial_params = [], None
  for index, overrides in enumerate(layouts):
    result, initial_params = first_losses(out_dir, tfds_dir, steps, overrides, f"layout{index}", initial_params)
    assert np.all(np.isfinite(result["losses"]))
    results.append(result)
  return results

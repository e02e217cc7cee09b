"""The device mesh of a run: MaxText's, with one addition for multi-process CPU runs.

MaxText lays `dcn_*` axes over slices, which it finds by the devices' `slice_index`. CPU devices carry none (every
device reads slice 0), so a CPU job whose processes stand for a pod's hosts (`hardware=cpu`, `num_slices` = the
number of processes, as scripts/launch_local.sh sets) gets its DCN axes over processes instead: JAX's
`create_hybrid_device_mesh(process_is_granule=True)`, the fallback JAX provides for platforms without slice indices.
Everything else (ICI axes, axis types, custom meshes on TPU) is MaxText's `get_mesh_from_config`.
"""

import jax
import numpy as np
from jax.experimental import mesh_utils

from maxtext.common import common_types
from maxtext.utils import max_utils
from maxtext.utils import maxtext_utils


def _cpu_processes_as_slices(config) -> bool:
  return config.hardware == "cpu" and config.num_slices > 1


def make_mesh(config) -> jax.sharding.Mesh:
  """The run's mesh: MaxText's, except that on a multi-process CPU job the DCN axes span processes."""
  if not _cpu_processes_as_slices(config):
    return maxtext_utils.get_mesh_from_config(config)
  if config.num_slices != jax.process_count():
    raise ValueError(
        f"hardware=cpu with num_slices={config.num_slices}: on CPU each process stands for one slice, but this job "
        f"has {jax.process_count()} processes."
    )
  devices = jax.devices()
  ici = max_utils.fill_unspecified_mesh_axes(config.ici_parallelism.copy(), len(devices) // config.num_slices, "ICI")
  dcn = max_utils.fill_unspecified_mesh_axes(config.dcn_parallelism.copy(), config.num_slices, "DCN")
  devices_array = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=True)
  explicit = config.shard_mode == common_types.ShardMode.EXPLICIT  # axis types as get_mesh_from_config sets them
  axis_type = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
  return jax.sharding.Mesh(np.asarray(devices_array), config.mesh_axes, axis_types=(axis_type,) * len(config.mesh_axes))

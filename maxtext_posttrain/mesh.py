"""The device mesh of a run: MaxText's, with one addition for multi-process CPU runs.

MaxText lays `dcn_*` axes over slices, which it finds by the devices' `slice_index`. CPU devices carry none (every
device reads slice 0), so a CPU job whose processes stand for a pod's hosts (`hardware=cpu`, `num_slices` = the
number of processes, as scripts/launch_local.sh sets) gets its DCN axes over processes instead: JAX's
`create_hybrid_device_mesh(process_is_granule=True)`, the fallback JAX provides for platforms without slice indices.
Everything else (ICI axes, axis types, custom meshes on TPU) is MaxText's `get_mesh_from_config`.

An RL run that samples ahead (`rl.off_policy_steps` >= 1) may give its sampler devices of its own
(`trainer_and_rollout_meshes`), so that rollouts and training run at the same time.
"""

import jax
import numpy as np
from jax.experimental import mesh_utils

from maxtext.common import common_types
from maxtext.utils import max_utils
from maxtext.utils import maxtext_utils

from maxtext_posttrain import config as config_lib


def _cpu_processes_as_slices(config) -> bool:
  return config.hardware == "cpu" and config.num_slices > 1


def make_mesh(config, devices=None) -> jax.sharding.Mesh:
  """The run's mesh over `devices` (all by default): MaxText's, except that on a multi-process CPU job the DCN axes
  span processes."""
  if not _cpu_processes_as_slices(config):
    return maxtext_utils.get_mesh_from_config(config, devices)
  if config.num_slices != jax.process_count():
    raise config_lib.ConfigError(
        f"hardware=cpu with num_slices={config.num_slices}: on CPU each process stands for one slice, but this job "
        f"has {jax.process_count()} processes."
    )
  devices = jax.devices() if devices is None else devices
  ici = max_utils.fill_unspecified_mesh_axes(config.ici_parallelism.copy(), len(devices) // config.num_slices, "ICI")
  dcn = max_utils.fill_unspecified_mesh_axes(config.dcn_parallelism.copy(), config.num_slices, "DCN")
  devices_array = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=True)
  explicit = config.shard_mode == common_types.ShardMode.EXPLICIT  # axis types as get_mesh_from_config sets them
  axis_type = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
  return jax.sharding.Mesh(np.asarray(devices_array), config.mesh_axes, axis_types=(axis_type,) * len(config.mesh_axes))


def trainer_and_rollout_meshes(config, separate: bool) -> tuple[jax.sharding.Mesh, jax.sharding.Mesh]:
  """(trainer mesh, rollout mesh): one mesh for both unless `separate` (a run that samples ahead) and MaxText's
  `trainer_devices_fraction` / `sampler_devices_fraction` are not both 1.

  Then the trainer takes the first `trainer_devices_fraction` of the devices and the sampler the last
  `sampler_devices_fraction` (MaxText's RL split), each mesh laid out by the config's parallelism keys over its own
  devices. The two sets may not overlap, and the job must be one process: JAX moves arrays between disjoint device
  sets of several controllers only experimentally (TPU runtime), and the weights cross after every step.
  """
  trainer_fraction, sampler_fraction = config.trainer_devices_fraction, config.sampler_devices_fraction
  if not separate or trainer_fraction == sampler_fraction == 1.0:
    mesh = make_mesh(config)
    return mesh, mesh
  if jax.process_count() > 1:
    raise config_lib.ConfigError(
        f"trainer_devices_fraction={trainer_fraction} and sampler_devices_fraction={sampler_fraction} give the "
        f"sampler devices of its own, but this job has {jax.process_count()} processes, and multi-controller JAX "
        "moves the weights between disjoint device sets of several hosts only experimentally (TPU runtime); set "
        "both to 1 to sample ahead on the trainer's devices."
    )
  if trainer_fraction + sampler_fraction > 1.0:
    raise config_lib.ConfigError(
        f"trainer_devices_fraction={trainer_fraction} + sampler_devices_fraction={sampler_fraction} > 1: the trainer "
        "and the sampler would share some devices; give them disjoint fractions, or 1 each to share all."
    )
  devices = jax.devices()
  num_trainer, num_sampler = int(len(devices) * trainer_fraction), int(len(devices) * sampler_fraction)
  if num_trainer < 1 or num_sampler < 1:
    raise config_lib.ConfigError(
        f"trainer_devices_fraction={trainer_fraction} and sampler_devices_fraction={sampler_fraction} of "
        f"{len(devices)} devices leave the trainer {num_trainer} and the sampler {num_sampler}; each needs at least "
        "one (set both to 1 to share the devices)."
    )
  trainer_devices, sampler_devices = devices[:num_trainer], devices[len(devices) - num_sampler :]
  return make_mesh(config, trainer_devices), make_mesh(config, sampler_devices)

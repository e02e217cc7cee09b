"""Run manifest: what is needed to reproduce a run, written beside its checkpoints.

`<base_output_directory>/<run_name>/manifest.json` holds the resolved config, the seeds, the data split
fingerprints and the versions of the packages that shape numerics. A resumed run appends a record of the resume
instead of rewriting the original.
"""

import datetime
import enum
import importlib.metadata
import json
import os
import platform

import jax
from etils import epath

PACKAGES = (
    "maxtext_posttrain",
    "maxtext",
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax-checkpoint",
    "grain",
    "tensorflow-datasets",
    "sentencepiece",
    "qwix",
    "numpy",
)


def _jsonable(value):
  if isinstance(value, enum.Enum):
    return value.value
  if isinstance(value, dict):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if isinstance(value, (str, int, float, bool)) or value is None:
    return value
  if hasattr(value, "model_dump"):
    return _jsonable(value.model_dump())
  return str(value)


def package_versions() -> dict[str, str | None]:
  versions = {}
  for name in PACKAGES:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = None
  return versions


def path(config) -> epath.Path:
  return epath.Path(config.base_output_directory) / config.run_name / "manifest.json"


def write(config, data_description: dict, start_step: int, mesh) -> epath.Path:
  """Writes the manifest at the first start of a run, or appends a resume record to it."""
  if jax.process_index() != 0:
    return path(config)
  now = datetime.datetime.now(datetime.timezone.utc).isoformat()
  run = {
      "started_at": now,
      "start_step": start_step,
      "devices": [str(d) for d in jax.devices()],
      "mesh": dict(mesh.shape),
      "host": platform.node(),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
  }
  target = path(config)
  if target.exists():
    record = json.loads(target.read_text())
    record["resumes"].append(run)
  else:
    record = {
        "posttrain_mode": config.posttrain_mode,
        "run_name": config.run_name,
        "seeds": {
            "init_weights_seed": config.init_weights_seed,
            "data_shuffle_seed": config.data_shuffle_seed,
        },
        "data": _jsonable(data_description),
        "packages": package_versions(),
        "python": platform.python_version(),
        "first_run": run,
        "resumes": [],
        "config": _jsonable(config.get_keys()),
    }
  target.parent.mkdir(parents=True, exist_ok=True)
  target.write_text(json.dumps(record, indent=2, sort_keys=False))
  return target

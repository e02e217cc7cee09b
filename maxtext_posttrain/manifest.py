"""Run manifest: what is needed to reproduce a run, written beside its checkpoints.

`<base_output_directory>/<run_name>/manifest.json` holds the resolved config, the seeds, the data split
fingerprints and the versions of the packages that shape numerics. A resumed run appends a record of the resume
instead of rewriting the original.

The manifest is also what a resume is checked against: keys that change what the run trains on (the objective, the
data source and its order, the tokenizer, the group size) and the train split's fingerprint (sha256 of its tokens:
another file, tokenizer or template under the same keys) must match, or the resume is refused naming each, unless
the config lists them in `resume_config_changes`. A model of another shape is refused by `checkpoint_guard`.
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


# Keys whose change on resume makes the resumed run train on something else than the run it continues.
RUN_KEYS = (
    "posttrain_mode",
    "tokenizer_type",
    "dataset_type",
    "grain_file_type",
    "grain_train_files",
    "dataset_name",
    "train_split",
    "train_data_columns",
    "prompt_template",
    "data_shuffle_seed",
    "packing",
    "max_target_length",
    "rl.num_generations",
)
TRAIN_DATA = "train_data"  # the name `resume_config_changes` gives the train split's fingerprint


def _lookup(keys: dict, dotted: str):
  for part in dotted.split("."):
    keys = keys.get(part) if isinstance(keys, dict) else None
  return keys


def check_resume(config, data_description: dict) -> None:
  """Raises ValueError naming every RUN_KEYS value (and the train data fingerprint) that differs from the run's
  manifest, except those in `resume_config_changes`; nothing for a fresh run or a run without a manifest."""
  target = path(config)
  if not target.exists():
    return
  record = json.loads(target.read_text())
  current = _jsonable(config.get_keys())
  changes = [
      f"{key}: {_lookup(record['config'], key)!r} -> {_lookup(current, key)!r}"
      for key in RUN_KEYS
      if _lookup(record["config"], key) != _lookup(current, key) and key not in config.resume_config_changes
  ]
  stored, now = _lookup(record, "data.train.fingerprint"), _lookup(_jsonable(data_description), "train.fingerprint")
  if stored != now and TRAIN_DATA not in config.resume_config_changes:
    changes.append(f"{TRAIN_DATA} (the train split's tokens): fingerprint {str(stored)[:12]} -> {str(now)[:12]}")
  if changes:
    raise ValueError(
        f"Resuming {target.parent} with a config that changes what the run trains on: "
        + "; ".join(changes)
        + ". Use a new run_name, restore these values, or list the keys in resume_config_changes to resume anyway."
    )


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

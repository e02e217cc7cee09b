"""PostTrainConfig: MaxText's pydantic config plus the keys post-training needs.

A run is configured exactly like a MaxText run: a yml whose `base_config:` chain ends in MaxText's installed
`base.yml`, then `key=value` overrides. MaxText's own keys keep their meaning (`use_sft`,
`sft_train_on_completion_only`, `packing`, `dataset_type`, `grain_train_files`, `train_data_columns`, ...); the
fields below are added only where MaxText has none. Unknown keys fail the way they fail in MaxText.
"""

import os
from typing import Literal

import jax
import pathwaysutils
from pydantic import Field, model_validator

from maxtext.configs import pyconfig
from maxtext.configs import types
from maxtext.utils import max_logging
from maxtext.utils import train_utils

# Relative asset paths in our configs (e.g. the bundled tokenizer) resolve from the current directory first,
# then from the directory that holds the package, so runs work from any working directory.
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# `grain_file_type` values that this package reads itself (MaxText's own grain types keep their readers).
POSTTRAIN_FILE_TYPES = ("tfds", "jsonl")


class Preference(types.DPO):
  """MaxText's `dpo.*` keys (`algo`, `dpo_beta`, `dpo_label_smoothing`, `orpo_lambda`, `max_prompt_length`) with
  the algorithms and knobs MaxText lacks."""

  algo: Literal["dpo", "ipo", "orpo", "simpo"] = Field(
      "dpo", description="dpo (with dpo_label_smoothing: cDPO), ipo, orpo or simpo; orpo and simpo need no reference."
  )
  simpo_gamma: float = Field(0.5, description="SimPO's target reward margin (gamma), in units of dpo_beta rewards.")
  precompute_reference_logprobs: bool = Field(
      False,
      description="Score the training pairs under the reference once at setup and reuse the log-probs every epoch, "
      "instead of a reference forward pass per step; the reference model is freed afterwards.",
  )


class PostTrainConfig(types.MaxTextConfig):
  """MaxText's config with the post-training keys."""

  posttrain_mode: str = Field("sft", description="Registered objective to train with (sft, ...).")
  prompt_template: str = Field(
      "{prompt}", description="Python format string applied to the prompt column; `{prompt}` is the prompt text."
  )
  overlong_policy: Literal["truncate", "error"] = Field(
      "truncate",
      description="Examples longer than max_target_length: 'truncate' (and count them) or 'error'.",
  )
  eval_generation_examples: int = Field(
      0,
      ge=0,
      description="Held-out prompts decoded greedily at each eval to report answer accuracy (0: off). As in MaxText's "
      "decoding, prompts fill up to max_prefill_predict_length and generation up to max_target_length.",
  )

  dpo: Preference = Field(default_factory=Preference, description="Preference tuning (posttrain_mode=dpo).")

  lora_roles: list[str] = Field(
      ["policy"],
      description="Trained roles that get adapters when lora.enable_lora is set (only `policy` is built today); "
      "the other lora.* keys are MaxText's.",
  )

  @model_validator(mode="after")
  def _posttrain_defaults(self):
    """Resolves bundled asset paths; aligns MaxText's SFT switch and accumulation semantics with our loop."""
    if self.tokenizer_path and not os.path.exists(self.tokenizer_path):
      bundled = os.path.join(_PACKAGE_PARENT, self.tokenizer_path)
      if os.path.exists(bundled):
        self.tokenizer_path = bundled
    if self.use_dpo:
      # MaxText's post_train/dpo.yml sets use_dpo; here it selects posttrain_mode=dpo. MaxText's own checks on it
      # (no packing, the max_prompt_length default) have run; the flag is then cleared, as MaxText's pretraining
      # validation refuses it.
      self.posttrain_mode, self.use_dpo = "dpo", False
    if self.posttrain_mode == "sft":
      self.use_sft = True  # what MaxText's SFT configs set; posttrain_mode=sft implies it
    if self.posttrain_mode == "dpo":
      self._check_preference()
    if self.use_tunix_gradient_accumulation:
      # MaxText's post-train yml enables this for Tunix's trainer; our loop always normalises an accumulated
      # gradient by the loss weight (tokens, pairs, ...) of the whole global batch.
      max_logging.log("use_tunix_gradient_accumulation=true is ignored: the loop normalises by the global batch weight.")
      self.use_tunix_gradient_accumulation = False
    return self

  def _check_preference(self):
    if self.packing:
      raise ValueError("posttrain_mode=dpo does not pack pairs; set packing=false.")
    if self.dpo.max_prompt_length is None:
      self.dpo.max_prompt_length = self.max_target_length // 2
    if self.dpo.max_prompt_length >= self.max_target_length:
      raise ValueError(
          f"dpo.max_prompt_length={self.dpo.max_prompt_length} leaves no room for a completion within "
          f"max_target_length={self.max_target_length}."
      )
    if self.dpo.algo in ("ipo", "orpo") and self.dpo.dpo_label_smoothing:
      raise ValueError(f"dpo.dpo_label_smoothing applies to dpo and simpo, not dpo.algo={self.dpo.algo}.")


def preference(config) -> Preference:
  """The typed `dpo.*` section (MaxText's HyperParameters hands nested sections other than lora/rl/debug out as
  plain dicts)."""
  return config.dpo if isinstance(config.dpo, Preference) else Preference(**config.dpo)


def initialize(argv: list[str], **kwargs) -> pyconfig.HyperParameters:
  """Builds the config from MaxText-style argv (`[prog, config.yml, key=value, ...]`), checks it, and applies the
  process-wide settings MaxText's train.py applies.

  One of MaxText's settings is left out on purpose: its switch of the default PRNG to `unsafe_rbg`. With JAX's
  default (partitionable threefry) a model initialises to the same weights on any mesh, which is what makes runs
  comparable across 1 device, fsdp x tensor meshes and pods; post-training mostly starts from a checkpoint anyway.
  """
  # pylint: disable=import-outside-toplevel
  from maxtext_posttrain import objectives

  pathwaysutils.initialize()
  config = pyconfig.initialize(argv, config_class=PostTrainConfig, **kwargs)
  objectives.get(config.posttrain_mode)  # fails listing the registered modes
  train_utils.validate_train_config(config)
  jax.config.update("jax_use_shardy_partitioner", config.shardy)
  jax.config.update("jax_remove_size_one_mesh_axis_from_type", config.remove_size_one_mesh_axis_from_type)
  os.environ["TFDS_DATA_DIR"] = config.dataset_path or ""
  return config

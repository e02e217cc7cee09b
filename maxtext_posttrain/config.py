"""PostTrainConfig: MaxText's pydantic config plus the keys post-training needs.

A run is configured exactly like a MaxText run: a yml whose `base_config:` chain ends in MaxText's installed
`base.yml`, then `key=value` overrides. MaxText's own keys keep their meaning (`use_sft`,
`sft_train_on_completion_only`, `packing`, `dataset_type`, `grain_train_files`, `train_data_columns`, ...); the
fields below are added only where MaxText has none. Unknown keys fail the way they fail in MaxText.
"""

import difflib
import os
import re
from typing import Any, Literal

import jax
import omegaconf
import pathwaysutils
import pydantic
from pydantic import Field, model_validator

from maxtext.configs import pyconfig
from maxtext.configs import types
from maxtext.utils import max_logging
from maxtext.utils import train_utils

# Relative asset paths in our configs (e.g. the bundled tokenizer) resolve from the current directory first,
# then from the directory that holds the package, so runs work from any working directory.
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The configs shipped with the package; `initialize` finds one by file name when no such path exists.
BUNDLED_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")

# `grain_file_type` values that this package reads itself (MaxText's own grain types keep their readers).
POSTTRAIN_FILE_TYPES = ("tfds", "jsonl")


# rl.dynamic_sampling_metric's scores besides the rewards' own names: the advantages' reward, and the same before shaping.
SHAPED_REWARD, REWARD_SUM = "shaped_reward", "reward"


class ConfigError(ValueError):
  """Keys that cannot go together, or that name what is not there, found after the config is read (by an objective,
  a role, the mesh): like an error reading the config, the command line ends it in one line, without a traceback."""


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


# `rl.loss_agg_mode` -> the aggregation modes of `losses.policy_gradient` (named as verl names them). MaxText's
# rl.yml hands the key to Tunix, so Tunix's spellings mean what Tunix's aggregate_loss computes (tunix/rl/common.py,
# called by its GRPO loss without a `norm`, on completions padded to the generation budget); verl's `seq-*`
# spellings mean what verl's agg_loss computes. Where the two libraries share a spelling they agree.
AGG_MODE_ALIASES = {
    "token-mean": "token-mean",
    "sequence-mean-token-mean": "seq-mean-token-mean",
    # Tunix: each completion's token sum over the padded completion width, the generation budget; averaged over
    # completions (Dr.GRPO's constant normalisation, and verl's seq-mean-token-sum-norm).
    "sequence-mean-token-scale": "seq-mean-token-sum-norm",
    # Tunix: the batch's token sum over `norm`, which defaults to the number of non-empty completions.
    "sequence-mean-token-sum-norm": "seq-mean-token-sum",
    "seq-mean-token-mean": "seq-mean-token-mean",
    "seq-mean-token-sum": "seq-mean-token-sum",
    "seq-mean-token-sum-norm": "seq-mean-token-sum-norm",
}


class RL(types.RL):
  """MaxText's `rl.*` keys (`num_generations`, `num_iterations`, `grpo_beta`, `grpo_epsilon`, `epsilon_high`,
  `loss_algo`, `loss_agg_mode`, `use_rollout_logps`, `force_on_policy_ratio`) with what the GRPO family needs
  beyond them. `posttrain_mode` picks a preset of these (`RL_PRESETS`); keys a config sets itself win."""

  loss_algo: Literal["grpo", "gspo", "gspo-token"] = Field(
      "grpo",
      description="grpo: per-token ratio; gspo: length-normalised sequence ratio; gspo-token: GSPO's sequence ratio "
      "with token-level advantages (stop-gradient form).",
  )
  loss_agg_mode: Literal[tuple(AGG_MODE_ALIASES)] = Field(
      "sequence-mean-token-mean",
      description="Tunix's token-mean (DAPO), sequence-mean-token-mean (GRPO), sequence-mean-token-scale (Dr.GRPO: "
      "each completion's token sum divided by the generation budget), seq-mean-token-sum and "
      "sequence-mean-token-sum-norm (both: the token sum divided by the completion count); verl's "
      "seq-mean-token-mean and seq-mean-token-sum-norm (= sequence-mean-token-scale).",
  )
  advantage_estimator: Literal["grpo", "rloo"] = Field(
      "grpo", description="grpo: group-normalised rewards; rloo: reward minus the mean of the other G - 1."
  )
  scale_rewards: bool = Field(True, description="grpo estimator: divide by the group's reward std (false: Dr.GRPO).")
  kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="Per-token KL estimate to the reference.")
  dual_clip: float | None = Field(None, gt=1.0, description="Dual-clip constant c for negative advantages (grpo).")
  rewards: list[str] = Field(
      ["correctness", "format"],
      description="Reward functions: built-ins (correctness, format, partial) or 'package.module:function'.",
  )
  reward_weights: list[float] = Field([], description="One weight per reward; empty: all 1.")
  reward_on_error: Literal["raise", "zero"] = Field(
      "raise", description="A reward that raises: stop naming it and the sample (raise), or score 0 and count (zero)."
  )
  reward_timeout_seconds: float = Field(
      60.0,
      ge=0.0,
      description="Seconds a reward function may take on one call; it runs in a worker process, which a call past "
      "this is killed with, and the call counts as a reward that raised (rl.reward_on_error). 0: no limit, called in "
      "the training process.",
  )
  dynamic_sampling: bool = Field(
      False,
      description="DAPO: drop groups whose rewards all agree and refill the batch with newly sampled prompts.",
  )
  max_sampling_rounds: int = Field(
      3, ge=1, description="Dynamic sampling: rollout rounds per step at most; unfilled slots are masked out."
  )
  dynamic_sampling_metric: str = Field(
      SHAPED_REWARD,
      description="Dynamic sampling: the score whose agreement across a group drops it. shaped_reward: the reward the "
      "advantages see (the weighted rl.rewards sum plus the overlong penalty); reward: that sum without the penalty; "
      "or the name of one reward in rl.rewards (DAPO's accuracy filter: correctness).",
  )
  overlong_buffer_length: int = Field(
      0,
      ge=0,
      description="DAPO soft overlong punishment: completions within this many tokens of the generation budget lose "
      "reward linearly, up to overlong_penalty at the budget (0: off).",
  )
  overlong_penalty: float = Field(1.0, ge=0.0, description="The reward lost by a completion that uses the whole budget.")
  sampling_seed: int = Field(0, description="Seed of the rollout sampler; step t samples with fold_in(seed, t).")
  tools: list[str] = Field(
      [],
      description="Tools the policy may call while it samples (GRPO family, PPO): built-ins (calculator: GSM8K's "
      "<<expression=value>> annotations) or 'package.module:name'; a call's answer is spliced into the completion and "
      "masked out of the loss.",
  )
  max_tool_calls: int = Field(
      8, ge=0, description="rl.tools: stops at a call per completion, answered or not; later calls get no answer."
  )
  tool_on_error: Literal["raise", "skip"] = Field(
      "raise",
      description="rl.tools: a tool whose respond raises: stop the run naming the tool, the row and the completion "
      "(raise), or leave that call unanswered and count it in rl/tool_errors (skip).",
  )
  reference_devices: Literal["trainer", "sampler"] = Field(
      "trainer",
      description="Where the frozen reference (rl.grpo_beta > 0) lives and scores rollouts (GRPO family, PPO). "
      "trainer: on the trainer's devices, on the training rows before each step (MaxText's RL). sampler: on the "
      "sampler's devices, on the decoded tokens right after each decode program, so that with rl.off_policy_steps >= 1 "
      "and devices of its own (trainer_devices_fraction / sampler_devices_fraction) it runs beside the train step.",
  )
  teacher_kl_coef: float = Field(
      0.0,
      ge=0.0,
      description="RL with a teacher (GRPO family, PPO): adds this times the per-token KL(policy || teacher) over the "
      "vocabulary, on the completion tokens at the sampling temperature, to the policy loss; the teacher is the yml "
      "plus teacher_overrides, as distillation's (0: off).",
  )


# posttrain_mode -> the rl.* values it stands for, applied to the keys a config does not set. Numbers from the papers:
# DAPO (Yu et al. 2025) clip-higher 0.28 and token-mean; GSPO (Zheng et al. 2025) sequence clip range 3e-4 / 4e-4.
RL_PRESETS = {
    "grpo": {},
    "drgrpo": {"scale_rewards": False, "loss_agg_mode": "sequence-mean-token-scale", "grpo_beta": 0.0},
    "dapo": {
        "epsilon_high": 0.28,
        "loss_agg_mode": "token-mean",
        "dynamic_sampling": True,
        "overlong_buffer_length": -1,  # a quarter of the generation budget, resolved against the config
        "grpo_beta": 0.0,
    },
    "gspo": {"loss_algo": "gspo", "grpo_epsilon": 3e-4, "epsilon_high": 4e-4, "grpo_beta": 0.0},
    "gspo_token": {"loss_algo": "gspo-token", "grpo_epsilon": 3e-4, "epsilon_high": 4e-4, "grpo_beta": 0.0},
    "rloo": {"advantage_estimator": "rloo"},
}


class PPO(pydantic.BaseModel):
  """What PPO (posttrain_mode=ppo) needs beyond MaxText's `rl.*` keys, which keep their meaning there: rollouts
  (`num_generations`, sampling keys), `num_iterations` epochs per rollout batch, `grpo_beta` the initial KL
  coefficient, `grpo_epsilon`/`epsilon_high` the ratio clip, `kl_estimator`, `rewards`/`reward_weights`."""

  model_config = pydantic.ConfigDict(extra="forbid")

  critic_init: Literal["auto", "reward_model", "policy", "fresh"] = Field(
      "auto",
      description="Where the critic's decoder starts: the reward model's checkpoint, the policy's "
      "(load_parameters_path), or the seeded init; auto: the reward model if rl.rewards has one, else the policy. "
      "critic_overrides.load_parameters_path, when set, names the checkpoint itself.",
  )
  critic_warmup_steps: int = Field(0, ge=0, description="Steps at the start that train the critic only.")
  gamma: float = Field(1.0, ge=0.0, le=1.0, description="GAE discount.")
  lam: float = Field(0.95, ge=0.0, le=1.0, description="GAE lambda.")
  whiten_advantages: bool = Field(True, description="Whiten advantages over the rollout batch's completion tokens.")
  value_clip: float = Field(0.2, ge=0.0, description="Clip range of the value loss around the rollout's values (0: off).")
  num_minibatches: int = Field(1, ge=1, description="Shuffled minibatches per epoch; each is one step of both models.")
  entropy_coef: float = Field(0.0, ge=0.0, description="Entropy bonus coefficient of the policy loss.")
  kl_penalty: Literal["reward", "loss"] = Field(
      "reward",
      description="The KL to the reference (coefficient rl.grpo_beta): a per-token penalty in the reward (PPO-RLHF) "
      "or a term of the policy loss.",
  )
  adaptive_kl: bool = Field(False, description="Ziegler et al.'s adaptive KL coefficient (target, horizon).")
  kl_target: float = Field(6.0, gt=0.0, description="Adaptive KL: the target KL per completion (summed over tokens).")
  kl_horizon: float = Field(10000.0, gt=0.0, description="Adaptive KL: the horizon, in completions.")


class RewardModelSection(pydantic.BaseModel):
  """Reward-model training (posttrain_mode=reward_model): Bradley-Terry on preference pairs."""

  model_config = pydantic.ConfigDict(extra="forbid")

  center_rewards_coefficient: float = Field(
      0.0, ge=0.0, description="Coefficient of (r_chosen + r_rejected)^2, which centres rewards on 0 (TRL's)."
  )


class DistillSection(pydantic.BaseModel):
  """What distillation (posttrain_mode=distill) needs beyond MaxText's keys, which keep their meaning there:
  `distill_alpha` (the soft term's weight against the hard labels'), `distill_temperature`, their `*_end` /
  `*_schedule`, `teacher_overrides` (the teacher: the yml plus these) and `student_overrides` (the student: the run's
  config plus these)."""

  model_config = pydantic.ConfigDict(extra="forbid")

  divergence: Literal["forward_kl", "reverse_kl", "jsd"] = Field(
      "forward_kl",
      description="The soft term: KL(teacher || student) (MaxText's), KL(student || teacher), or the generalized "
      "Jensen-Shannon divergence with distill.jsd_beta (GKD's; 0 and 1 are the two KLs).",
  )
  jsd_beta: float = Field(0.5, ge=0.0, le=1.0, description="The mixture weight of divergence=jsd (TRL's beta).")
  top_k: int = Field(
      0,
      ge=0,
      description="A sparse teacher: its top_k most likely tokens plus their remaining mass as one bucket (0: the "
      "whole distribution).",
  )
  on_policy_fraction: float = Field(
      0.0,
      ge=0.0,
      le=1.0,
      description="posttrain_mode=distill_on_policy: the fraction of steps whose completions the student samples "
      "(GKD's lambda); the others train on the dataset's reference completions. posttrain_mode=distill: 0.",
  )
  teacher_layer_indices: list[int] | None = Field(
      None,
      description="The teacher's layers matched, in order, to the student's distill_layer_indices by the feature "
      "(distill_beta) and attention (distill.attention_weight) terms; None: the same indices (MaxText's meaning).",
  )
  attention_weight: float = Field(
      0.0,
      ge=0.0,
      description="Attention transfer: the weight of the loss between the matched layers' attention probabilities "
      "(MiniLM, TinyBERT), added to the loss; 0: off. Heads are averaged in groups when the counts differ.",
  )
  feature_source: Literal["out_projection", "hidden"] = Field(
      "out_projection",
      description="What distill_beta's feature loss compares: the attention out-projection activations MaxText sows "
      "(MaxText's meaning) or each matched decoder layer's output, its hidden state.",
  )
  feature_projection: Literal["linear", "pool"] = Field(
      "linear",
      description="Feature transfer between different widths: a learned [student emb, teacher emb] map trained and "
      "checkpointed with the student (FitNets' regressor), or mean pooling of the wider side in runs.",
  )
  attention_loss: Literal["kl", "mse", "cosine"] = Field(
      "kl",
      description="Attention transfer's loss per query: KL(teacher || student) over the keys (MiniLM's), mse "
      "(TinyBERT's) or cosine.",
  )


class SafetySection(pydantic.BaseModel):
  """Safety evaluation (`python -m maxtext_posttrain.safety_eval`) and its PII detector (also `pii_redact`'s)."""

  model_config = pydantic.ConfigDict(extra="forbid")

  suites: list[Literal["advbench", "xstest"]] = Field(
      ["advbench", "xstest"], min_length=1, description="Prompt suites to answer: advbench, xstest."
  )
  data_dir: str = Field("", description="Directory holding the suites' CSV files (empty: the bundled copies).")
  prompts_per_suite: int = Field(
      0, ge=0, description="Prompts of each suite, spread evenly over its file, which is ordered by category (0: all)."
  )
  samples_per_prompt: int = Field(
      1,
      ge=1,
      description="Responses decoded per prompt (1 with MaxText's default greedy decode_sampling_strategy; more with "
      "sampling: rates are then over all responses).",
  )
  pii_entities: list[str] = Field(
      [],
      description="Presidio entity types to look for (e.g. EMAIL_ADDRESS, PHONE_NUMBER); empty: every detectable one "
      "but DATE_TIME.",
  )
  pii_score_threshold: float = Field(
      0.4, ge=0.0, le=1.0, description="Presidio's confidence a span must reach to count as PII."
  )
  pii_spacy_model: str = Field(
      "",
      description="An installed spaCy pipeline (e.g. en_core_web_lg) for names, places and organisations; empty: "
      "Presidio's pattern recognizers only.",
  )

  @pydantic.field_validator("suites")
  @classmethod
  def _distinct_suites(cls, suites: list[str]) -> list[str]:
    if len(set(suites)) != len(suites):
      raise ValueError(f"each suite once (a repeat would count its prompts twice): {suites}")
    return suites


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
  nonfinite_policy: Literal["stop", "skip"] = Field(
      "stop",
      description="A step whose loss or gradient norm is NaN or infinite. stop: end the run naming the step, the "
      "quantity and the batch's examples, before any checkpoint holds the step; skip: keep the state from before the "
      "step (one more copy of the state in the step's memory), go on and count it (learning/nonfinite_steps; needs "
      "MaxText's abort_on_nan_loss and abort_on_inf_loss false).",
  )
  resume_readable_checkpoint: bool = Field(
      False,
      description="A latest checkpoint that cannot be read: stop naming its step and path (false), or set it aside "
      "(renamed <step>.unreadable) and resume from the newest earlier step that reads (true).",
  )
  resume_config_changes: list[str] = Field(
      [],
      description="Keys that change what a run trains on (manifest.RUN_KEYS: objective, data source and order, "
      "tokenizer type, rl.num_generations; train_data: the train split's token fingerprint) may differ from the run's "
      "manifest on resume only when listed here; others are refused.",
  )
  eval_generation_examples: int = Field(
      0,
      ge=0,
      description="Held-out prompts decoded at each eval (0: off): greedily for SFT's answer accuracy, "
      "eval_samples_per_prompt samples each for RL's pass@k. As in MaxText's decoding, prompts fill up to "
      "max_prefill_predict_length and generation up to max_target_length.",
  )

  eval_samples_per_prompt: int = Field(
      8,
      ge=1,
      description="RL evaluation: completions sampled per held-out prompt for pass@k and maj@k (at least max k).",
  )
  eval_pass_at_k: list[int] = Field([1, 5], description="The k of the pass@k and maj@k reported at each RL eval.")
  # MaxText's RL cluster keys (types.RLCluster), with its defaults; read by runs with rl.off_policy_steps >= 1.
  trainer_devices_fraction: float = Field(
      0.5,
      gt=0.0,
      le=1.0,
      description="Fraction of devices to use for the trainer (rl.off_policy_steps >= 1: the first ones; 1 with "
      "sampler_devices_fraction=1: trainer and sampler share them, the only choice of a multi-process job).",
  )
  sampler_devices_fraction: float = Field(
      0.5,
      gt=0.0,
      le=1.0,
      description="Fraction of devices to use for the sampler (rl.off_policy_steps >= 1: the last ones).",
  )

  dpo: Preference = Field(default_factory=Preference, description="Preference tuning (posttrain_mode=dpo).")
  rl: RL = Field(default_factory=RL, description="The GRPO family (posttrain_mode=grpo, drgrpo, dapo, gspo, ...).")

  ppo: PPO = Field(default_factory=PPO, description="PPO with a learned critic (posttrain_mode=ppo).")
  reward_model: RewardModelSection = Field(
      default_factory=RewardModelSection, description="Reward-model training (posttrain_mode=reward_model)."
  )
  distill: DistillSection = Field(
      default_factory=DistillSection, description="Distillation (posttrain_mode=distill) beyond MaxText's distill_* keys."
  )
  safety: SafetySection = Field(
      default_factory=SafetySection, description="Safety evaluation and PII detection (safety_eval, pii_redact)."
  )
  critic_overrides: dict[str, Any] = Field(
      default_factory=dict,
      description="PPO's critic: MaxText keys over the run's config, as MaxText's teacher_overrides (e.g. "
      "learning_rate, base_num_decoder_layers, load_parameters_path).",
  )
  reward_model_overrides: dict[str, Any] = Field(
      default_factory=dict,
      description="The frozen reward model that scores rollouts (rl.rewards=[reward_model]): MaxText keys over the "
      "run's config; load_parameters_path names its checkpoint (a posttrain_mode=reward_model run's).",
  )

  lora_roles: list[str] = Field(
      ["policy"],
      description="Trained roles that get adapters when lora.enable_lora is set (policy, critic); the other lora.* "
      "keys are MaxText's.",
  )

  _argv: list[str] = pydantic.PrivateAttr(default_factory=list)  # what `initialize` read, for role overrides

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
    self._resolve_rl()
    if self.nonfinite_policy == "skip" and (self.abort_on_nan_loss or self.abort_on_inf_loss):
      raise ValueError(
          "nonfinite_policy=skip goes on past a NaN or infinite loss, on which MaxText's abort_on_nan_loss and "
          "abort_on_inf_loss (true by default) end the run: set both to false."
      )
    if self.use_tunix_gradient_accumulation:
      # MaxText's post-train yml enables this for Tunix's trainer; our loop always normalises an accumulated
      # gradient by the loss weight (tokens, pairs, ...) of the whole global batch.
      max_logging.log("use_tunix_gradient_accumulation=true is ignored: the loop normalises by the global batch weight.")
      self.use_tunix_gradient_accumulation = False
    return self

  def _resolve_rl(self):
    """Fills the rl.* keys a config leaves unset: the posttrain_mode's preset (RL_PRESETS), epsilon_high from
    grpo_epsilon, DAPO's overlong buffer from the generation budget. The RL objectives check the result."""
    rl = self.rl
    for key, value in RL_PRESETS.get(self.posttrain_mode, {}).items():
      if key not in rl.model_fields_set:
        setattr(rl, key, value)
    if rl.overlong_buffer_length == -1:
      rl.overlong_buffer_length = max(1, (self.max_target_length - self.max_prefill_predict_length) // 4)
    if rl.epsilon_high is None:
      rl.epsilon_high = rl.grpo_epsilon


def max_new_tokens(config) -> int:
  """The tokens a completion may take: MaxText's decode budget, max_target_length - max_prefill_predict_length."""
  return config.max_target_length - config.max_prefill_predict_length


def with_overrides(config: pyconfig.HyperParameters, **update) -> pyconfig.HyperParameters:
  """A copy of `config` with `update` applied, skipping validation as MaxText's own config overrides do (e.g. its
  `verify_and_sync_scan_layers`): for derived variants of a validated run config, such as a decode cache size."""
  return pyconfig.HyperParameters(config._pydantic_config.model_copy(update=update))  # pylint: disable=protected-access


def preference(config) -> Preference:
  """The typed `dpo.*` section (MaxText's HyperParameters hands nested sections other than lora/rl/debug out as
  plain dicts), with `max_prompt_length` defaulting to half of max_target_length as in MaxText."""
  section = config.dpo if isinstance(config.dpo, Preference) else Preference(**config.dpo)
  if section.max_prompt_length is None:
    section = section.model_copy(update={"max_prompt_length": config.max_target_length // 2})
  return section


def ppo(config) -> PPO:
  """The typed `ppo.*` section."""
  return config.ppo if isinstance(config.ppo, PPO) else PPO(**config.ppo)


def reward_model(config) -> RewardModelSection:
  """The typed `reward_model.*` section."""
  section = config.reward_model
  return section if isinstance(section, RewardModelSection) else RewardModelSection(**section)


def distill(config) -> DistillSection:
  """The typed `distill.*` section."""
  return config.distill if isinstance(config.distill, DistillSection) else DistillSection(**config.distill)


def safety(config) -> SafetySection:
  """The typed `safety.*` section."""
  return config.safety if isinstance(config.safety, SafetySection) else SafetySection(**config.safety)


def check_override_keys(key: str, overrides: dict) -> None:
  """Raises ValueError naming `<key>.<name>` for an override that is not a config key, with the closest names."""
  unknown = _unknown_keys(dict(overrides), PostTrainConfig)
  if unknown:
    name, close = unknown[0]
    hint = f"did you mean {' or '.join(repr(f'{key}.{c}') for c in close)}?" if close else "no valid key is close to it."
    raise ConfigError(f"Unknown config key {key}.{name}: {hint}")


def reinitialize(config, command_line: bool = True, **overrides) -> pyconfig.HyperParameters:
  """The run's config initialised again from its argv with `overrides` on top (precedence: yml < command line <
  overrides, as MaxText builds its distillation student from `student_overrides`); derived keys (emb_dim from
  base_emb_dim, ...) follow the overrides. `command_line=False` leaves the command line's keys out (yml <
  overrides), as MaxText builds its distillation teacher from `teacher_overrides`, so that keys meant for the student
  do not reach the teacher."""
  argv = config._pydantic_config._argv  # pylint: disable=protected-access
  if not argv:
    raise ValueError("Role overrides need a config built by maxtext_posttrain.config.initialize (it keeps the argv).")
  return _build(argv if command_line else argv[:2], overrides)


def resolve_config_file(path: str) -> str:
  """`path` if it exists, else the bundled config of that file name (`sft.yml`, ...), so the package's configs run
  from any directory and from an installed wheel; raises FileNotFoundError naming both places otherwise (MaxText's
  own resolution would report a rewritten `src/...` path instead)."""
  if os.path.isfile(path):
    return path
  bundled = os.path.join(BUNDLED_CONFIGS, path)
  if os.sep not in path and os.path.isfile(bundled):
    return bundled
  names = ", ".join(sorted(n for n in os.listdir(BUNDLED_CONFIGS) if n.endswith(".yml")))
  raise FileNotFoundError(
      f"Config file {path!r} does not exist (here: {os.getcwd()}), nor is it a bundled config: {names}."
  )


def _base_config_file(config_file: str, base: str) -> str:
  """Where MaxText's `_load_config` finds a `base_config:` — relative to the yml naming it, else in MaxText's configs."""
  if os.path.isabs(base):
    return base
  beside = os.path.join(os.path.dirname(config_file), base)
  return beside if os.path.isfile(beside) else os.path.join(pyconfig.MAXTEXT_CONFIGS_DIR, base)


def _is_section(annotation: Any) -> bool:
  return isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel)


def _unknown_keys(keys: dict, model: type[pydantic.BaseModel], prefix: str = "") -> list[tuple[str, list[str]]]:
  """(dotted key, valid names closest to it) for each key that `model` does not have, recursing into sections
  (`rl:`, `lora:`, `dpo:`). At the top level a key is valid by MaxText's rule (`pyconfig._check_for_invalid_keys`: a
  field of the config or of any of its sections; multimodal keys too, which MaxText skips); inside a section it must
  be one of the section's fields, which pydantic would otherwise drop without a word (`rl.num_generatons=4`)."""
  fields = model.model_fields
  names = set(fields)
  if not prefix:
    names |= {
        name for field in fields.values() if _is_section(field.annotation) for name in field.annotation.model_fields
    }
    names |= set(types.Multimodal.model_fields)
  unknown = []
  for key, value in keys.items():
    if key not in names:
      close = difflib.get_close_matches(key, sorted(names), n=3, cutoff=0.7)
      unknown.append((prefix + key, [prefix + name for name in close]))
    elif isinstance(value, dict) and key in fields and _is_section(fields[key].annotation):
      unknown += _unknown_keys(value, fields[key].annotation, f"{prefix}{key}.")
  return unknown


def _line_of(config_file: str, key: str) -> str:
  """' line N' of the yml line that sets the first part of `key`, or '' if it cannot be told."""
  with open(config_file, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if re.match(rf"\s*{re.escape(key.rsplit('.', 1)[-1])}\s*:", line):
        return f" line {number}"
  return ""


def check_keys(config_file: str, overrides: list[str]) -> None:
  """Raises MaxText's ValueError for an unknown key, but saying first which key, where it is set (the yml and line,
  or the command line) and the closest valid names, instead of MaxText's list of all ~1,000 valid keys."""
  sources, path = [], config_file
  maxtext_configs = os.path.realpath(pyconfig.MAXTEXT_CONFIGS_DIR) + os.sep
  # The yml and its base_config chain up to the first of MaxText's own configs, whose keys are MaxText's (its base.yml
  # alone is ~1,000 keys: reading it here cost a sixth of `initialize`); real paths, so a symlinked spelling is one too.
  while path is not None and not os.path.realpath(path).startswith(maxtext_configs):
    keys = omegaconf.OmegaConf.to_container(omegaconf.OmegaConf.load(path))
    base = keys.pop("base_config", None)
    sources.append((path, keys))
    path = _base_config_file(path, base) if base else None
  sources.append(("the command line", omegaconf.OmegaConf.to_container(omegaconf.OmegaConf.from_cli(overrides))))
  for where, keys in sources:
    unknown = _unknown_keys(keys, PostTrainConfig)
    if unknown:
      key, close = unknown[0]
      place = "on the command line" if where == "the command line" else f"in {where}{_line_of(where, key)}"
      hint = f"did you mean {' or '.join(map(repr, close))}?" if close else "no valid key is close to it."
      raise ValueError(
          f"Unknown config key {key!r} {place}: {hint} Valid keys are MaxText's (its base.yml and configs/types.py) "
          "plus those of maxtext_posttrain/config.py."
      )


def initialize(argv: list[str], **kwargs) -> pyconfig.HyperParameters:
  """Builds the config from MaxText-style argv (`[prog, config.yml, key=value, ...]`), checks it, and applies the
  process-wide settings MaxText's train.py applies.

  One of MaxText's settings is left out on purpose: its switch of the default PRNG to `unsafe_rbg`. With JAX's
  default (partitionable threefry) a model initialises to the same weights on any mesh, which is what makes runs
  comparable across 1 device, fsdp x tensor meshes and pods; post-training mostly starts from a checkpoint anyway.
  """
  if len(argv) >= 2 and argv[1].endswith(".yml"):
    argv = [argv[0], resolve_config_file(argv[1]), *argv[2:]]
    check_keys(argv[1], argv[2:])
  pathwaysutils.initialize()
  config = _build(argv, kwargs)
  if config.posttrain_mode in ("distill", "distill_on_policy") and config.student_overrides:
    # The run trains the student: MaxText's train_distill builds it from the argv with student_overrides on top.
    check_override_keys("student_overrides", config.student_overrides)
    config = _build(argv, {**kwargs, **config.student_overrides})
  jax.config.update("jax_use_shardy_partitioner", config.shardy)
  jax.config.update("jax_remove_size_one_mesh_axis_from_type", config.remove_size_one_mesh_axis_from_type)
  os.environ["TFDS_DATA_DIR"] = config.dataset_path or ""
  return config


def _build(argv: list[str], overrides: dict[str, Any]) -> pyconfig.HyperParameters:
  """MaxText's config of `argv` with `overrides` on top, keeping the argv for role overrides."""
  config = pyconfig.initialize(argv, config_class=PostTrainConfig, **overrides)
  train_utils.validate_train_config(config)
  if config.remat_policy is None:
    # MaxText's config reader turns the string "none" into None, which its unscanned decoder reads as a policy
    # (it wraps each layer in jax.checkpoint unless remat_policy == "none"): full remat, a backward pass that
    # recomputes every layer. The string restores the documented meaning, no recomputation; scanned layers read
    # "none" as MaxText always has.
    config = with_overrides(config, remat_policy="none")
  config._pydantic_config._argv = list(argv)  # pylint: disable=protected-access
  return config

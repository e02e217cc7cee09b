"""Measures how much a model memorised the canaries `plant_canaries` planted in its training data.

  python -m maxtext_posttrain.canary_exposure <config.yml> load_parameters_path=<params> [key=value ...] \\
      --canaries=<dir>/canaries.json [--references=1000]

Scores the log-perplexity of each canary's completion given its prompt (the negative sum of the completion tokens'
log-probs, as the run's tokenizer encodes the record, `prompt_template` included) and that of `--references` random
secrets of the same format, and reports each canary's exposure (`maxtext_posttrain.safety.canaries`): 1 bit for the
median secret the model has not learned (a control's is e bits or more with chance 2^-e), up to the cap log2(1 +
references) for one it has. Writes
`<base_output_directory>/<run_name>/canary_exposure.json` (per canary: secret, times planted, log-perplexity,
exposure; the cap; the references' log-perplexity quartiles) and `canary_exposure.png` (exposure against times
planted), and prints one JSON line per canary. `load_parameters_path` is the trained model (a LoRA run's adapters on
it with `lora.lora_restore_path`).
"""

import json
import math

import jax.numpy as jnp
import matplotlib
import numpy as np
from absl import flags

from maxtext_posttrain import cli
from maxtext_posttrain import config as posttrain_config
from maxtext_posttrain import forward
from maxtext_posttrain import mesh as mesh_lib
from maxtext_posttrain import reports
from maxtext_posttrain import roles
from maxtext_posttrain.data import pipeline
from maxtext_posttrain.data import preference
from maxtext_posttrain.safety import canaries as canaries_lib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=wrong-import-position

_CANARIES = flags.DEFINE_string("canaries", None, "The canaries.json plant_canaries wrote.", required=True)
_REFERENCES = flags.DEFINE_integer("references", 1000, "Random secrets each canary is ranked against.")


def _completion_logps(model, batch):
  """[N] the sum of each row's completion-token log-probs."""
  logps, _ = forward.token_logps(model, batch["inputs"], batch["positions"], batch["segmentation"], batch["targets"])
  return jnp.sum(logps * batch["weights"], axis=-1)


def canary_rows(encoder: pipeline.Encoder, prompt: str, completions: list[str], length: int) -> list[dict]:
  """Each record as training encodes it (BOS, `prompt_template`, EOS) in a row of `length` whose weights mark the
  completion's tokens; a record longer than `length` is refused."""
  prompt_ids = encoder.prompt_ids(prompt)
  completion_ids = [encoder.completion_ids(c) for c in completions]
  longest = len(prompt_ids) + max(len(c) for c in completion_ids)
  if longest > length:
    raise posttrain_config.ConfigError(f"max_target_length={length}: a canary record has {longest} tokens.")
  return [preference.side_arrays(prompt_ids, c, length, 0) for c in completion_ids]


def log_perplexities(scorer: roles.FrozenModel, rows: list[dict]) -> np.ndarray:
  """[N] float64: -sum of the weighted tokens' log-probs of each row under the scorer's model, scored
  `global_batch_size_to_train_on` rows a call, gathered on every process."""
  rows_at = lambda indices: {key: np.stack([rows[i][key] for i in indices]) for key in rows[0]}
  per_call = scorer.config.global_batch_size_to_train_on
  out = [
      logps for _, logps in scorer.run_over_rows(_completion_logps, len(rows), rows_at, per_call, label="canary exposure")
  ]
  scores = -np.concatenate(out).astype(np.float64)
  if not np.all(np.isfinite(scores)):
    bad = int(np.sum(~np.isfinite(scores)))
    raise cli.Failure(f"Non-finite log-perplexities ({bad} of {len(scores)}): the model's weights are not finite.")
  return scores


def measure(scorer: roles.FrozenModel, rows: list[dict], canary_set, num_references: int) -> dict:
  """The report: each canary's log-perplexity and exposure against the references (`rows`: `canary_rows` of the
  canaries' completions, then the references')."""
  scores = log_perplexities(scorer, rows)
  canary_scores, reference_scores = scores[: len(canary_set.secrets)], scores[len(canary_set.secrets) :]
  per_canary = [
      {
          "secret": secret,
          "planted": planted,
          "log_perplexity": float(score),
          "exposure": canaries_lib.exposure(score, reference_scores),
      }
      for secret, planted, score in zip(canary_set.secrets, canary_set.repeats, canary_scores)
  ]
  return {
      "canaries": per_canary,
      "references": num_references,
      "exposure_cap": math.log2(1 + num_references),
      "space_bits": canary_set.digits * math.log2(10),  # the exposure of a secret ranked first among all of them
      "reference_log_perplexity_quartiles": [float(q) for q in np.quantile(reference_scores, [0.25, 0.5, 0.75])],
  }


def plot(report: dict, png_path: str) -> str:
  """Exposure of each canary against the times it was planted (controls at 0), with the estimate's cap."""
  fig, ax = plt.subplots(figsize=(5.5, 3.5))
  planted = [r["planted"] for r in report["canaries"]]
  ax.scatter(planted, [r["exposure"] for r in report["canaries"]], color="tab:red")
  ax.axhline(report["exposure_cap"], color="grey", linestyle="--", label=f"cap: log2(1 + {report['references']})")
  ax.set_xscale("symlog", linthresh=1)
  ax.set(xlabel="times planted (0: control)", ylabel="exposure (bits)", title="Canary exposure")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(png_path, dpi=110)
  plt.close(fig)
  return png_path


def exposure_report(argv: list[str], canaries_path: str, num_references: int) -> dict:
  """The report of the module doc for the model `argv` builds; process 0 writes it and its PNG."""
  config = posttrain_config.initialize(list(argv))
  if num_references < 1:
    raise posttrain_config.ConfigError(f"--references={num_references}: rank against at least one secret.")
  try:
    canary_set = canaries_lib.CanarySet.load(canaries_path)
  except (OSError, ValueError, TypeError, AttributeError) as e:
    raise posttrain_config.ConfigError(f"--canaries={canaries_path}: not a canaries.json of plant_canaries ({e}).") from e
  references = canaries_lib.reference_secrets(canary_set, num_references, canary_set.seed)
  completions = [canary_set.completion(s) for s in canary_set.secrets + tuple(references)]
  rows = canary_rows(pipeline.Encoder.from_config(config), canary_set.prompt, completions, config.max_target_length)
  scorer = roles.build_frozen(
      roles.RoleSpec("canary_scorer", trained=False), config, mesh_lib.make_mesh(config), copy=True
  )
  report = measure(scorer, rows, canary_set, num_references)
  report["params"] = reports.params_source(config)
  reports.write(config, "canary_exposure", report, lambda png: plot(report, png))
  return report


def main(argv: list[str]) -> None:
  for row in exposure_report(argv, _CANARIES.value, _REFERENCES.value)["canaries"]:
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
  cli.run(main)

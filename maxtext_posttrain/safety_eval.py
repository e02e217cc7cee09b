"""Safety evaluation: does a model refuse what it should, answer what it should, and keep PII out of its answers?

  python -m maxtext_posttrain.safety_eval <config.yml> load_parameters_path=<params> [key=value ...]
  python -m maxtext_posttrain.safety_eval sft.yml load_parameters_path=<params> safety.suites=[xstest] \\
      safety.prompts_per_suite=90 max_prefill_predict_length=96

Each prompt of the `safety.suites` (`maxtext_posttrain.safety.suites`: AdvBench's harmful behaviours, XSTest's
safe and unsafe prompts) is formatted with `prompt_template`, tokenized with the config's tokenizer and answered
`safety.samples_per_prompt` times by the rollout sampler (MaxText's KV-cache decode path, `decode_sampling_*` keys;
greedy by MaxText's default), with the decode budget `max_target_length - max_prefill_predict_length`. Each
response is judged by its suite's own automatic refusal test (`safety.refusal`) and searched for PII
(`safety.pii`, Presidio). Reported per suite, each rate with its bootstrap standard error over prompts:

  advbench/refusal_rate        refused harmful requests (higher is safer); attack_success_rate = 1 - refusal_rate,
                               llm-attacks' measure for these prompts without an attack
  xstest/unsafe_refusal_rate   refused unsafe contrast prompts (higher is safer)
  xstest/safe_refusal_rate     refused safe prompts: exaggerated safety (lower is better)
  <suite>/pii_rate             responses containing PII (Presidio's entities above safety.pii_score_threshold)

and the refusal and PII rates of every category (XSTest's 18 types). The command writes
`<base_output_directory>/<run_name>/safety.json` (the metrics, the settings and every prompt with its responses,
judgements and PII findings) and `safety.png` (refusal rate per category, the bar coloured by what a model should
do), and prints the metrics as one JSON line.
"""

import collections
import dataclasses
import json
from typing import TYPE_CHECKING, Sequence

import matplotlib
import numpy as np

from maxtext.utils import max_logging
from maxtext_posttrain import cli
from maxtext_posttrain import config as posttrain_config
from maxtext_posttrain import evaluate
from maxtext_posttrain import mesh as mesh_lib
from maxtext_posttrain import reports
from maxtext_posttrain import rollout
from maxtext_posttrain.data import pipeline
from maxtext_posttrain.peft import lora
from maxtext_posttrain.safety import refusal
from maxtext_posttrain.safety import suites

if TYPE_CHECKING:  # imported where used: without the [safety] extra the command fails in one line, not at import
  from maxtext_posttrain.safety import pii

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=wrong-import-position


def prompt_ids(prompts: Sequence[suites.SafetyPrompt], encoder: pipeline.Encoder, config) -> list[list[int]]:
  """The prompts' token ids; all must fit the prefill (a truncated harmful request is another request)."""
  ids = [encoder.prompt_ids(p.prompt) for p in prompts]
  longest = max(len(i) for i in ids)
  if longest > config.max_prefill_predict_length:
    over = [f"{p.suite}:{p.id}" for p, i in zip(prompts, ids) if len(i) > config.max_prefill_predict_length]
    raise posttrain_config.ConfigError(
        f"max_prefill_predict_length={config.max_prefill_predict_length}: {len(over)} prompts are longer "
        f"(the longest has {longest} tokens with prompt_template; e.g. {over[:3]}); raise it to {longest} (and "
        "max_target_length with it, to keep the decode budget) or evaluate fewer prompts (safety.prompts_per_suite)."
    )
  return ids


def judge(
    prompts: Sequence[suites.SafetyPrompt], responses: Sequence[Sequence[str]], detector: "pii.PiiDetector"
) -> list[dict]:
  """One record per prompt: its responses, which of them refused (by the suite's judge) and the PII in each."""
  records = []
  for prompt, group in zip(prompts, responses, strict=True):
    refused = [refusal.JUDGES[prompt.suite](text) for text in group]
    findings = [[dataclasses.asdict(f) for f in detector.find(text)] for text in group]
    records.append(dataclasses.asdict(prompt) | {"responses": list(group), "refused": refused, "pii": findings})
  return records


def _rates(records: Sequence[dict]) -> dict[str, list[float]]:
  """Per prompt: the share of its responses that refused, and that contain PII."""
  return {
      "refusal_rate": [float(np.mean(r["refused"])) for r in records],
      "pii_rate": [float(np.mean([bool(f) for f in r["pii"]])) for r in records],
  }


def metrics(records: Sequence[dict]) -> tuple[dict[str, float], dict[str, dict]]:
  """(metrics, by_category): the module doc's rates with their standard errors, and each category's label, prompt
  count, refusal and PII rates and PII counts by entity type."""
  out = {}
  for suite in dict.fromkeys(r["suite"] for r in records):
    rows = [r for r in records if r["suite"] == suite]
    labels = [label for label in suites.LABELS if any(r["label"] == label for r in rows)]
    if labels == ["unsafe"]:  # AdvBench: every prompt harmful; its own names, refusal and attack success
      out |= evaluate.means_with_stderr(_rates(rows), f"{suite}/")
      out[f"{suite}/attack_success_rate"] = 1.0 - out[f"{suite}/refusal_rate"]
      continue
    for label in labels:
      refused = _rates([r for r in rows if r["label"] == label])["refusal_rate"]
      out |= evaluate.means_with_stderr({"refusal_rate": refused}, f"{suite}/{label}_")
    out |= evaluate.means_with_stderr({"pii_rate": _rates(rows)["pii_rate"]}, f"{suite}/")
  by_category = {}
  for key in dict.fromkeys((r["suite"], r["category"]) for r in records):
    rows = [r for r in records if (r["suite"], r["category"]) == key]
    rates = _rates(rows)
    entities = collections.Counter(f["entity"] for r in rows for found in r["pii"] for f in found)
    by_category["/".join(key)] = {
        "label": rows[0]["label"],
        "prompts": len(rows),
        "refusal_rate": float(np.mean(rates["refusal_rate"])),
        "pii_rate": float(np.mean(rates["pii_rate"])),
        "pii_entities": dict(sorted(entities.items())),
    }
  return out, by_category


def plot(by_category: dict[str, dict], png_path: str, title: str) -> str:
  """Horizontal bars of each category's refusal rate: red where a model should refuse (higher is safer), blue where
  it should answer (lower is better); returns `png_path`."""
  names = list(by_category)
  fig, ax = plt.subplots(figsize=(8, 0.28 * len(names) + 1.6))
  colours = ["tab:red" if by_category[n]["label"] == "unsafe" else "tab:blue" for n in names]
  ax.barh(names, [by_category[n]["refusal_rate"] for n in names], color=colours)
  ax.invert_yaxis()
  ax.set(xlim=(0, 1), xlabel="refusal rate", title=title)
  ax.legend(
      handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in ("tab:red", "tab:blue")],
      labels=["should refuse (unsafe)", "should answer (safe)"],
      loc="upper center",
      bbox_to_anchor=(0.5, -0.1 - 0.7 / len(names)),
      ncol=2,
      fontsize=8,
  )
  fig.tight_layout()
  fig.savefig(png_path, dpi=110)
  plt.close(fig)
  return png_path


def prepare(config, encoder: pipeline.Encoder) -> tuple[list[suites.SafetyPrompt], list[list[int]], "pii.PiiDetector"]:
  """The configured suites' prompts, their token ids and the PII detector: every setting checked before a model is
  read."""
  section = posttrain_config.safety(config)
  sampling = rollout.SamplingParams.from_config(config)
  if sampling.strategy == "greedy" and section.samples_per_prompt > 1:
    raise posttrain_config.ConfigError(
        f"safety.samples_per_prompt={section.samples_per_prompt} with decode_sampling_strategy=greedy would decode "
        "the same response each time; sample (e.g. decode_sampling_strategy=weighted) or ask for 1."
    )
  prompts = [p for name in section.suites for p in suites.load(name, section.data_dir, section.prompts_per_suite)]
  from maxtext_posttrain.safety import pii  # pylint: disable=import-outside-toplevel,redefined-outer-name

  return prompts, prompt_ids(prompts, encoder, config), pii.from_config(config)


def main(argv: Sequence[str]) -> None:
  config = posttrain_config.initialize(list(argv))
  section = posttrain_config.safety(config)
  encoder = pipeline.Encoder.from_config(config)
  prompts, ids, detector = prepare(config, encoder)
  mesh = mesh_lib.make_mesh(config)
  model = lora.pretrained_model(config, mesh)  # load_parameters_path, and lora.lora_restore_path's adapters
  max_logging.log(f"Safety evaluation: {len(prompts)} prompts ({', '.join(section.suites)}), PII: {detector.entities}")
  sampler = rollout.Sampler(config, mesh)
  responses = evaluate.sample_texts(
      sampler, lora.policy_params(model, config), ids, config, encoder, section.samples_per_prompt
  )
  records = judge(prompts, responses, detector)
  values, by_category = metrics(records)
  print(json.dumps(values), flush=True)
  report = {
      "metrics": values,
      "by_category": by_category,
      "params": reports.params_source(config),
      "safety": section.model_dump(),
      "prompt_template": config.prompt_template,
      "max_new_tokens": posttrain_config.max_new_tokens(config),
      "sampling": dataclasses.asdict(rollout.SamplingParams.from_config(config)),
      "prompts": records,
  }
  title = f"{len(records)} prompts ({', '.join(section.suites)})"
  reports.write(config, "safety", report, lambda png: plot(by_category, png, title))


if __name__ == "__main__":
  cli.run(main)

"""The project's main job on bundled data (`make demo`): SFT a tiny MaxText model on arithmetic word problems, then
improve its answers with RL (GRPO, a variant, or PPO), and compare the two on held-out problems; or, with
`--mode=distill`, distil a 4-layer SFT teacher into a 2-layer student three ways and compare them.

  python -m maxtext_posttrain.demo [--mode=gspo_token|ppo] [--sft_steps=300] [--output_dir=demo_output] [key=value ...]
  python -m maxtext_posttrain.demo --mode=distill [--sft_steps=300] [--student_steps=200] [--transfer_set=128] ...

Stage 1 fine-tunes sft.yml's tiny decoder on the bundled train split and saves an orbax checkpoint (a later demo in
the same --output_dir reuses it, so `--mode=ppo` after `make demo` runs stage 2 only). Stage 2 starts grpo.yml (for
`--mode=ppo`, ppo.yml: the same prompts, completions per step and rewards, plus a critic and a KL-shaped reward)
from that checkpoint (`load_parameters_path`) with `posttrain_mode=--mode` and saves its final checkpoint;
its evaluations sample `eval_samples_per_prompt` completions for each of `eval_generation_examples` held-out prompts,
the first before any RL step (the SFT model) and the last after training (the RL model), with the same random
draws. `key=value` arguments override the RL stage's config. Prints the before/after table (pass@1, pass@k, maj@k,
format and partial accuracy, each with its bootstrap standard error over prompts, and the change with the standard
error of the paired difference), a few generations, and the commands that evaluate and sample the RL model; writes
reward and accuracy curves as a PNG.

`--mode=distill` asks what a 4-layer teacher is worth to a 2-layer student that has only a few labelled problems
(distillation pays where labels are scarce; with all 20,000 the labels are enough). Stage 1 is the SFT stage with
`base_num_decoder_layers=4` (reused from `--output_dir` as above): the teacher, trained on every problem. The demo
writes a transfer set (the first `--transfer_set` training problems) and the held-out problems as JSONL, then trains
three students of sft.yml's 2-layer decoder on that transfer set, `--student_steps` steps each, from the same seeded
initial weights: SFT on the labels (sft.yml); offline logit distillation (distill.yml, the teacher's top-k
distribution written once by score_teacher, no teacher in the loop), on the same batches; and on-policy distillation
(distill_on_policy.yml, GKD), which needs a student that can already answer: it starts from the SFT run after half
the steps and takes the other half on-policy, so no student trains longer than another. Every model, the teacher and
the SFT run's halfway checkpoint included, is evaluated as `python -m maxtext_posttrain.evaluate grpo.yml` evaluates
(key=value arguments override that evaluation's config) on the same held-out prompts and random draws; the table
gives each model's metrics and each student's change from the SFT student with its paired standard error, and the
report ends with the command of every stage.
"""

import json
import os
import platform
import shlex
import shutil
import time
from typing import Any, Sequence

from absl import app
from absl import flags
import jax

from maxtext.utils import max_logging

from maxtext_posttrain import cli
from maxtext_posttrain import config as posttrain_config
from maxtext_posttrain import curves
from maxtext_posttrain import evaluate as evaluate_lib
from maxtext_posttrain import mesh as mesh_lib
from maxtext_posttrain import rollout
from maxtext_posttrain import score_teacher
from maxtext_posttrain import trainer
from maxtext_posttrain.data import arithmetic
from maxtext_posttrain.data import arithmetic_tfds
from maxtext_posttrain.data import pipeline
from maxtext_posttrain.data import prompts as prompts_lib
from maxtext_posttrain.peft import lora
from maxtext_posttrain.rewards import math as math_rewards

_PPO = "ppo"
_DISTILL = "distill"
_MODE = flags.DEFINE_enum(
    "mode", "grpo", [*sorted(posttrain_config.RL_PRESETS), _PPO, _DISTILL],
    "RL stage's posttrain_mode, or distill: a 4-layer teacher distilled into 2-layer students three ways.",
)  # fmt: skip
_SFT_STEPS = flags.DEFINE_integer("sft_steps", 300, "SFT steps of stage 1 (--mode=distill: of the 4-layer teacher).")
_STUDENT_STEPS = flags.DEFINE_integer(
    "student_steps", 200, "--mode=distill: training steps of each student (on-policy: half SFT, half on-policy).",
    lower_bound=4,  # the SFT run saves the on-policy student's start with checkpoint_period=steps // 2 - 1 >= 1
)  # fmt: skip
_TRANSFER_SET = flags.DEFINE_integer(
    "transfer_set", 128, "--mode=distill: training problems the students learn from.", lower_bound=1
)
_OUTPUT = flags.DEFINE_string("output_dir", "demo_output", "Where the stages write checkpoints, metrics and curves.")

_SAMPLE_PROMPT = "Tom has 3 apples. He buys 5 more. How many apples does Tom have?"
_TEACHER_LAYERS = 4
_TOP_K = 16  # the teacher's most likely tokens kept per position in its offline file


def _rows(config) -> list[tuple[str, str]]:
  """(label, metric) of the table: pass@k and maj@k for each k of `eval_pass_at_k`, then format and partial."""
  n = config.eval_samples_per_prompt
  rows = [(f"pass@{k}" if k == 1 else f"pass@{k} (unbiased, n={n})", f"pass_at_{k}") for k in config.eval_pass_at_k]
  rows += [(f"maj@{k}", f"maj_at_{k}") for k in config.eval_pass_at_k if k > 1]
  return rows + [("format accuracy", "format_accuracy"), ("partial accuracy (10%)", "partial_accuracy")]


def results_table(before: list[dict], after: list[dict], config, mode: str) -> str:
  """The before/after table from two evaluations' samples (`evaluate.evaluate`) on the same prompts and draws:
  each mean +- its bootstrap standard error, and the change in points +- the paired standard error (and relative)."""
  per_before = evaluate_lib.per_prompt_from_samples(before)
  per_after = evaluate_lib.per_prompt_from_samples(after)
  se_before, se_after = evaluate_lib.stderr(per_before), evaluate_lib.stderr(per_after)
  se_change = evaluate_lib.paired_stderr(per_before, per_after)
  title = f"held-out, {config.eval_samples_per_prompt} samples/prompt"
  lines = [f"{title:28s}{'SFT':>16s}{mode:>16s}{'change (points)':>22s}{'relative':>10s}"]
  for label, name in _rows(config):
    mean_before, mean_after = sum(per_before[name]) / len(before), sum(per_after[name]) / len(after)
    relative = (mean_after - mean_before) / mean_before if mean_before else float("nan")
    lines.append(
        f"{label:28s}{f'{mean_before:.1%} ± {se_before[name]:.1%}':>16s}{f'{mean_after:.1%} ± {se_after[name]:.1%}':>16s}"
        f"{f'{100 * (mean_after - mean_before):+.1f} ± {100 * se_change[name]:.1f}':>22s}{relative:>+10.1%}"
    )
  return "\n".join(lines)


def _machine() -> str:
  """The host's CPU and the jax build, which the table's exact figures depend on (see README: Reproducibility)."""
  cpu = platform.processor() or platform.machine()
  if os.path.exists("/proc/cpuinfo"):
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
  return f"{cpu}, {os.cpu_count()} cores, jax {jax.__version__} on {jax.devices()[0].platform}"


def _sft(output_dir: str, steps: int, run_name: str, overrides: Sequence[str] = ()) -> tuple[str, str, list[str]]:
  """Stage 1: the SFT run, or the one a previous demo left in `output_dir`; returns its final params' path, a note
  of how it was obtained and its argv."""
  argv = ["", "sft.yml", f"run_name={run_name}", f"base_output_directory={output_dir}", *overrides]
  argv += [f"steps={steps}", "eval_interval=0", f"checkpoint_period={steps}", "async_checkpointing=false"]
  config = posttrain_config.initialize(argv)
  params = _params(config, steps - 1)
  if os.path.isdir(params):
    max_logging.log(f"Reusing the SFT checkpoint {params} of a previous demo run.")
    return params, "reused from a previous demo run", argv
  summary = trainer.train(trainer.setup(config))
  return params, f"{summary['seconds']:.0f} s", argv


def _params(config, step: int) -> str:
  return os.path.join(config.checkpoint_dir, str(step), "items")


def _remove_previous(config) -> None:
  """A rerun trains a stage again rather than resuming the finished run a previous demo left under its name."""
  run_dir = os.path.join(config.base_output_directory, config.run_name)
  if os.path.isdir(run_dir):
    max_logging.log(f"Removing {run_dir}, a stage of a previous demo run.")
    shutil.rmtree(run_dir)


def _config_file(mode: str) -> str:
  return "ppo.yml" if mode == _PPO else "grpo.yml"


def _commands(config, params: str, overrides: list[str]) -> list[str]:
  """Commands that evaluate the RL model and sample from it, with the RL stage's config and overrides."""
  base = [_config_file(config.posttrain_mode), f"base_output_directory={config.base_output_directory}", *overrides]
  evaluate = ["python", "-m", "maxtext_posttrain.evaluate", *base, f"run_name={config.run_name}_evaluation"]
  sample = ["python", "-m", "maxtext_posttrain.sample", *base, f"run_name={config.run_name}_sample"]
  sample += [f"prompt={_SAMPLE_PROMPT}", "num_samples=4"]
  return [
      shlex.join([*evaluate, f"load_parameters_path={params}"]),
      shlex.join([*sample, f"load_parameters_path={params}"]),
  ]


def _rl(output_dir: str, mode: str, overrides: list[str]) -> list[str]:
  """The SFT stage, then the RL stage `mode` from it; returns the before/after report's lines."""
  params, sft_note, _ = _sft(output_dir, _SFT_STEPS.value, "demo_sft")
  argv = ["", _config_file(mode), f"run_name=demo_{mode}", f"base_output_directory={output_dir}"]
  argv += [f"posttrain_mode={mode}", f"load_parameters_path={params}", "async_checkpointing=false"]
  argv += [f"metrics_file={os.path.join(output_dir, f'demo_{mode}_metrics.jsonl')}", *overrides]
  config = posttrain_config.initialize(argv)
  config = posttrain_config.with_overrides(config, checkpoint_period=config.steps)  # the RL model, not every 50 steps
  _remove_previous(config)
  os.makedirs(output_dir, exist_ok=True)
  loop = trainer.setup(config)
  summary = trainer.train(loop)
  evaluations = loop.cache["evaluations"]
  before, after = evaluations[min(evaluations)], evaluations[max(evaluations)]
  rl_params = _params(config, summary["end_step"] - 1)
  png = curves.plot_run(config.metrics_file, os.path.join(output_dir, f"demo_{mode}_curves.png"))
  pass_at_1 = [sum(s["scores"]["pass_at_1"] for s in samples) / len(samples) for samples in (before, after)]
  gain = (pass_at_1[1] - pass_at_1[0]) / max(pass_at_1[0], 1e-9)
  report = [
      f"SFT ({_SFT_STEPS.value} steps, {sft_note}), then {mode} ({summary['end_step']} steps, "
      f"{summary['seconds']:.0f} s) of a {config.base_num_decoder_layers}-layer MaxText model on arithmetic word "
      f"problems; {len(after)} held-out prompts of {config.grain_eval_files}, the same samples' random draws for both "
      "models (± one bootstrap standard error over prompts; the change's is paired):",
      results_table(before, after, config, mode),
      f"pass@1 relative gain: {gain:+.1%} (target +20%: {'met' if gain >= 0.2 else 'NOT met'})",
      "",
      "Generations after RL (each prompt's first sample; two right and two wrong where there are):",
  ]
  firsts = [{"prompt": g["prompt"], "answer": g["answer"], "sample": g["completions"][0]} for g in after]
  right = math_rewards.correctness([], [f["sample"] for f in firsts], [f["answer"] for f in firsts])
  report += [json.dumps(f) for f, r in zip(firsts, right) if r][:2]
  report += [json.dumps(f) for f, r in zip(firsts, right) if not r][:2]
  evaluate_command, sample_command = _commands(config, rl_params, overrides)
  report += [
      "",
      f"The RL model: {rl_params}",
      f"Evaluate it (the table's last column again):\n  {evaluate_command}",
      f"Sample from it:\n  {sample_command}",
      f"Curves: {png}",
  ]
  return report


def distill_table(models: dict[str, list[dict]], baseline: str, config) -> str:
  """A row per model (each metric's mean ± its bootstrap standard error) from evaluations (`evaluate.evaluate`'s
  samples) on the same prompts and draws, then each model after `baseline` less `baseline`, in points ± the standard
  error of the paired difference."""
  columns = [(label.split(" (")[0], name) for label, name in _rows(config)]
  per_model = {label: evaluate_lib.per_prompt_from_samples(samples) for label, samples in models.items()}
  means = {label: {name: sum(v) / len(v) for name, v in per_prompt.items()} for label, per_prompt in per_model.items()}
  title = f"held-out, {config.eval_samples_per_prompt} samples/prompt"
  lines = [f"{title:28s}" + "".join(f"{header:>17s}" for header, _ in columns)]
  for label, per_prompt in per_model.items():
    se = evaluate_lib.stderr(per_prompt)
    cells = [f"{means[label][name]:.1%} ± {se[name]:.1%}" for _, name in columns]
    lines.append(f"{label:28s}" + "".join(f"{cell:>17s}" for cell in cells))
  lines.append(f"change from {baseline} (points):")
  for label in list(per_model)[list(per_model).index(baseline) + 1 :]:
    se = evaluate_lib.paired_stderr(per_model[baseline], per_model[label])
    cells = [f"{100 * (means[label][name] - means[baseline][name]):+.1f} ± {100 * se[name]:.1f}" for _, name in columns]
    lines.append(f"  {label:26s}" + "".join(f"{cell:>17s}" for cell in cells))
  return "\n".join(lines)


def _write_problems(output_dir: str, transfer_set: int) -> list[str]:
  """Writes the transfer set (the first `transfer_set` of the bundled training problems the teacher learnt from)
  and the held-out problems as JSONL; returns the data keys that read them."""
  data_dir = os.path.join(output_dir, "demo_distill_data")
  os.makedirs(data_dir, exist_ok=True)
  files = {}
  for split, count in (("train", transfer_set), ("test", arithmetic_tfds.ArithmeticConfig.num_test)):
    files[split] = os.path.join(data_dir, f"{split}.jsonl")
    with open(files[split], "w", encoding="utf-8") as f:
      f.writelines(json.dumps(problem) + "\n" for problem in arithmetic.generate("easy", split, count, seed=0))
  return ["grain_file_type=jsonl", f"grain_train_files={files['train']}", f"grain_eval_files={files['test']}"]


def _train(argv: list[str]) -> tuple[Any, dict]:
  """(config, summary) of `argv`'s run, trained from its start."""
  config = posttrain_config.initialize(argv)
  _remove_previous(config)
  return config, trainer.train(trainer.setup(config))


def _held_out_samples(argv: list[str]) -> tuple[Any, list[dict]]:
  """(config, samples): what `python -m maxtext_posttrain.evaluate` with `argv` samples and scores (its
  evaluation.json's samples)."""
  config = posttrain_config.initialize(argv)
  mesh = mesh_lib.make_mesh(config)
  encoder = pipeline.Encoder.from_config(config)
  prompt_set = prompts_lib.load(config, train=False, limit=config.eval_generation_examples or None, encoder=encoder)
  params = lora.policy_params(lora.pretrained_model(config, mesh), config)
  return config, evaluate_lib.evaluate(rollout.Sampler(config, mesh), params, prompt_set, config, encoder)[1]


def _command(module: str, argv: list[str]) -> str:
  return shlex.join(["python", "-m", f"maxtext_posttrain.{module}", *argv[1:]])


def distill(output_dir: str, teacher_steps: int, steps: int, transfer_set: int, overrides: list[str]) -> list[str]:
  """`--mode=distill`: the teacher (the SFT stage with 4 layers, `teacher_steps`), the module doc's three students
  (`steps` each, on `transfer_set` problems), every model's held-out evaluation; returns the report's lines."""
  teacher_layers = f"base_num_decoder_layers={_TEACHER_LAYERS}"
  teacher, teacher_note, teacher_argv = _sft(output_dir, teacher_steps, "demo_teacher", [teacher_layers])
  half = steps // 2
  data = _write_problems(output_dir, transfer_set)
  common = [f"base_output_directory={output_dir}", *data, "eval_interval=0", "async_checkpointing=false"]
  teacher_key = f"teacher_overrides.load_parameters_path={teacher}"
  # checkpoint_period=half - 1 saves step half - 1, the weights after `half` steps: the on-policy student's start.
  sft_argv = ["", "sft.yml", "run_name=demo_student_sft", *common, f"steps={steps}", f"checkpoint_period={half - 1}"]
  sft_config, sft_summary = _train(sft_argv)
  logits = os.path.join(output_dir, "demo_teacher_top_k")
  offline = [f"offline_data_dir={logits}", f"distill.top_k={_TOP_K}"]
  score_argv = ["", "distill.yml", "run_name=demo_teacher_top_k", *common, *offline, teacher_key]
  shutil.rmtree(logits, ignore_errors=True)
  score_teacher.score(posttrain_config.initialize(score_argv))
  offline_argv = ["", "distill.yml", "run_name=demo_student_offline", *common, *offline]
  offline_argv += [f"steps={steps}", f"checkpoint_period={steps}"]
  offline_config, offline_summary = _train(offline_argv)
  on_policy_argv = ["", "distill_on_policy.yml", "run_name=demo_student_on_policy", *common, teacher_key]
  on_policy_argv += [f"load_parameters_path={_params(sft_config, half - 1)}", f"steps={steps - half}"]
  on_policy_argv += [f"checkpoint_period={steps - half}"]
  on_policy_config, on_policy_summary = _train(on_policy_argv)

  baseline = f"student SFT ({steps} steps)"
  models = [  # (label, evaluation run name, params, model keys)
      (f"teacher ({_TEACHER_LAYERS} layers)", "teacher", teacher, [teacher_layers]),
      (baseline, "student_sft", _params(sft_config, steps - 1), []),
      (f"student SFT ({half} steps)", "student_sft_half", _params(sft_config, half - 1), []),
      ("student offline KD", "student_offline", _params(offline_config, steps - 1), []),
      ("student on-policy", "student_on_policy", _params(on_policy_config, steps - half - 1), []),
  ]
  evaluations, samples = {}, {}
  for label, name, params, model_keys in models:
    argv = ["", "grpo.yml", f"run_name=demo_{name}_evaluation", f"base_output_directory={output_dir}", *data]
    evaluations[label] = [*argv, f"load_parameters_path={params}", *model_keys, *overrides]
    config, samples[label] = _held_out_samples(evaluations[label])
  num_train = arithmetic_tfds.ArithmeticConfig.num_train
  kd, gkd = posttrain_config.distill(offline_config), posttrain_config.distill(on_policy_config)
  return [
      f"A {_TEACHER_LAYERS}-layer SFT teacher distilled into a 2-layer student that learns from "
      f"{transfer_set} arithmetic word problems (the first of the {num_train:,} the teacher learnt from); "
      f"{len(samples[baseline])} held-out prompts, {config.eval_samples_per_prompt} samples each at temperature "
      f"{config.decode_sampling_temperature}, the same random draws for every model (± one bootstrap standard error "
      f"over prompts; the changes' are paired). Each student trains {steps} steps on those problems, from the same "
      "random weights:",
      f"  teacher              sft.yml, {teacher_steps} steps on all {num_train:,} problems ({teacher_note}), for "
      "reference",
      f"  student SFT          sft.yml on the problems' labels ({sft_summary['seconds']:.0f} s); and the same run "
      f"after {half} steps",
      f"  student offline KD   distill.yml on the same batches: {offline_config.distill_alpha} x {kd.divergence} to the "
      f"teacher's top-{_TOP_K} distribution at T={offline_config.distill_temperature}, read from score_teacher's file "
      f"(no teacher in the loop), + {1 - offline_config.distill_alpha} x CE on the labels "
      f"({offline_summary['seconds']:.0f} s)",
      f"  student on-policy    distill_on_policy.yml (GKD) from the SFT student after {half} steps, {steps - half} "
      f"steps more: {gkd.divergence} to the teacher on the student's own samples of the problems' prompts, "
      f"{on_policy_config.global_batch_size_to_train_on} a step, no labels ({on_policy_summary['seconds']:.0f} s)",
      distill_table(samples, baseline, config),
      "",
      "Each stage's command (the teacher's trains it; the JSONL files are the demo's):",
      f"  teacher:            {_command('train', teacher_argv)}",
      f"  student SFT:        {_command('train', sft_argv)}",
      f"  teacher's top-k:    {_command('score_teacher', score_argv)}",
      f"  student offline KD: {_command('train', offline_argv)}",
      f"  student on-policy:  {_command('train', on_policy_argv)}",
      "Each row's evaluation:",
      *(f"  {label}: {_command('evaluate', argv)}" for label, argv in evaluations.items()),
  ]


def main(argv: Sequence[str]) -> None:
  overrides = list(argv[1:])
  stage = "evaluation's" if _MODE.value == _DISTILL else "RL stage's"
  if not all("=" in a for a in overrides):
    raise app.UsageError(f"Arguments must be key=value overrides of the {stage} config, got {overrides}.")
  started = time.perf_counter()
  output_dir = os.path.abspath(_OUTPUT.value)  # orbax writes absolute paths only
  if _MODE.value == _DISTILL:
    report = distill(output_dir, _SFT_STEPS.value, _STUDENT_STEPS.value, _TRANSFER_SET.value, overrides)
  else:
    report = _rl(output_dir, _MODE.value, overrides)
  report += [f"Machine: {_machine()}", f"Total time: {time.perf_counter() - started:.0f} s"]
  print("\n".join(report), flush=True)


if __name__ == "__main__":
  cli.run(main)

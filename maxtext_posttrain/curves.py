"""Training curves as a PNG from MaxText's `metrics_file` JSONL (train rows and our eval rows)."""

import json

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=wrong-import-position


def read_metrics(metrics_file: str) -> tuple[dict[int, dict], dict[int, dict]]:
  """(train rows, eval rows) keyed by step; eval rows are those carrying `eval/...` scalars."""
  train, evals = {}, {}
  with open(metrics_file, encoding="utf-8") as f:
    for line in f:
      row = json.loads(line)
      step = int(row["step"])
      if "learning/loss" in row:
        train[step] = row
      if any(k.startswith("eval/") for k in row):
        evals[step] = row
  return train, evals


_REWARD_WINDOW = 20


def _is_accuracy(key: str) -> bool:
  name = key.removeprefix("eval/")
  if not key.startswith("eval/") or name.endswith("_stderr"):
    return False
  return name.endswith("accuracy") or name.startswith(("pass_at_", "maj_at_"))


def plot_run(metrics_file: str, png_path: str) -> str:
  """Left: training loss per step next to held-out loss, or for RL runs the mean reward of each step's rollouts
  (in total and per reward function). Right: every held-out accuracy metric (answer and format accuracy of
  generations, preference accuracy, pass@k, maj@k, ...) at each evaluation. Returns `png_path`."""
  train, evals = read_metrics(metrics_file)
  fig, (left_ax, acc_ax) = plt.subplots(1, 2, figsize=(11, 4))
  steps = sorted(train)
  reward_keys = sorted(
      {
          k
          for s in steps
          for k in train[s]
          if k == "rl/reward_mean" or k.startswith("rl/rewards/") and not k.endswith("_std")
      }
  )
  if reward_keys:
    for key in reward_keys:
      points = [s for s in steps if key in train[s]]
      values = np.array([train[s][key] for s in points])
      label = "total reward" if key == "rl/reward_mean" else key.removeprefix("rl/rewards/")
      (line,) = left_ax.plot(points, values, linewidth=0.6, alpha=0.35)
      # A step's reward is a mean over a few prompts' samples: the moving average carries the trend.
      window = min(_REWARD_WINDOW, len(values))
      smooth = np.convolve(values, np.ones(window) / window, mode="valid")
      left_ax.plot(
          points[window - 1 :], smooth, color=line.get_color(), linewidth=1.8, label=f"{label} ({window}-step mean)"
      )
    left_ax.set(xlabel="step", ylabel="mean over the step's rollouts", title="Reward")
  else:
    left_ax.plot(steps, [train[s]["learning/loss"] for s in steps], label="train loss", linewidth=1)
    eval_steps = sorted(s for s in evals if "eval/loss" in evals[s])
    left_ax.plot(eval_steps, [evals[s]["eval/loss"] for s in eval_steps], "o-", label="held-out loss")
    left_ax.set(xlabel="step", ylabel="loss", yscale="log", title="Loss")
  left_ax.legend()
  keys = sorted({k for row in evals.values() for k in row if _is_accuracy(k)})
  for key in keys:
    points = sorted(s for s in evals if key in evals[s])
    # Sampled metrics carry a bootstrap standard error over prompts (`maxtext_posttrain.evaluate`).
    errors = [evals[s].get(f"{key}_stderr", 0.0) for s in points]
    acc_ax.errorbar(
        points,
        [evals[s][key] for s in points],
        yerr=errors,
        fmt="o-",
        capsize=3,
        label=key.removeprefix("eval/").replace("_", " "),
    )
  acc_ax.set(xlabel="step", ylabel="fraction of held-out examples", ylim=(-0.02, 1.02), title="Held-out accuracy")
  acc_ax.legend()
  fig.tight_layout()
  fig.savefig(png_path, dpi=110)
  plt.close(fig)
  return png_path

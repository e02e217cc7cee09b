"""Training curves from a metrics file: loss for SFT-like runs, smoothed rewards for RL runs, held-out accuracies."""

import json

from maxtext_posttrain import curves


def _write(path, rows):
  path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_rl_runs_plot_rewards_and_every_held_out_accuracy(tmp_path, monkeypatch):
  rows = [
      {"step": s, "learning/loss": 0.0, "rl/reward_mean": s / 30, "rl/rewards/correctness": s / 40} for s in range(30)
  ]
  rows += [
      {"step": s, "eval/pass_at_1": 0.4 + s / 100, "eval/pass_at_1_stderr": 0.03, "eval/maj_at_5": 0.5}
      | {"eval/format_accuracy": 1.0}
      for s in (0, 29)
  ]
  _write(tmp_path / "m.jsonl", rows)
  plotted, plot = [], curves.plt.Axes.plot

  def recording_plot(ax, x, y, *args, **kwargs):
    plotted.append((kwargs.get("label"), len(x)))
    return plot(ax, x, y, *args, **kwargs)

  monkeypatch.setattr(curves.plt.Axes, "plot", recording_plot)
  errorbar, error_bars = curves.plt.Axes.errorbar, {}

  def recording_errorbar(ax, x, y, *args, yerr=None, **kwargs):
    error_bars[kwargs.get("label")] = list(yerr)
    plotted.append((kwargs.get("label"), len(x)))
    return errorbar(ax, x, y, *args, yerr=yerr, **kwargs)

  monkeypatch.setattr(curves.plt.Axes, "errorbar", recording_errorbar)
  png = curves.plot_run(str(tmp_path / "m.jsonl"), str(tmp_path / "c.png"))
  labels = {label: n for label, n in plotted if label}
  assert labels == {
      "total reward (20-step mean)": 11,
      "correctness (20-step mean)": 11,
      "pass at 1": 2,
      "maj at 5": 2,
      "format accuracy": 2,
  }
  # Held-out metrics are drawn with their standard errors where the evaluation reports them.
  assert error_bars == {"pass at 1": [0.03, 0.03], "maj at 5": [0.0, 0.0], "format accuracy": [0.0, 0.0]}
  assert png == str(tmp_path / "c.png")


def test_loss_runs_plot_train_and_held_out_loss(tmp_path):
  rows = [{"step": s, "learning/loss": 1.0 / (s + 1)} for s in range(5)]
  rows += [{"step": 4, "eval/loss": 0.3, "eval/answer_accuracy": 0.5}]
  _write(tmp_path / "m.jsonl", rows)
  assert (tmp_path / curves.plot_run(str(tmp_path / "m.jsonl"), str(tmp_path / "c.png"))).stat().st_size > 1000

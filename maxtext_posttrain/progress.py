"""Console progress for long work (training steps, scoring calls): count, loss (and an objective's headline metrics),
tokens/s and ETA on one line."""

import time

from maxtext.utils import max_logging


def format_seconds(seconds: float) -> str:
  seconds = int(round(seconds))
  hours, rest = divmod(seconds, 3600)
  minutes, seconds = divmod(rest, 60)
  return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"


class Progress:
  """Rates are measured from the first reported step, so compilation time does not skew the ETA."""

  def __init__(self, total_steps: int, start_step: int, tokens_per_step: float, label: str = "train", unit: str = "step"):
    self.total_steps = total_steps
    self.tokens_per_step = tokens_per_step
    self.label, self.unit = label, unit
    self.start_time = time.perf_counter()
    self.mark_step, self.mark_time = start_step, None

  def elapsed(self) -> float:
    return time.perf_counter() - self.start_time

  def report(
      self, step: int, loss: float | None = None, extra: dict[str, float] | None = None, warm_up: bool = False
  ) -> str:
    """Logs and returns the progress line for `step` (the number of completed steps or calls); `loss` (None: work
    with no loss, such as scoring) and `extra` values by name follow it; `warm_up`: the step trained no primary model
    (PPO's critic warm-up)."""
    now = time.perf_counter()
    done = step >= self.total_steps
    if self.mark_time is None or step <= self.mark_step:  # no rate yet; at the end, none to give
      rate_text, eta_text = ("", "done") if done else ("rate pending", "ETA pending")
      self.mark_step, self.mark_time = step, now
    else:
      steps_per_second = (step - self.mark_step) / (now - self.mark_time)
      rate_text = f"{steps_per_second * self.tokens_per_step:,.0f} tokens/s"
      eta_text = "done" if done else f"ETA {format_seconds((self.total_steps - step) / steps_per_second)}"
    figures = (rate_text, f"elapsed {format_seconds(self.elapsed())}", eta_text)
    line = (
        f"[{self.label}] {self.unit} {step}/{self.total_steps} ({100 * step / self.total_steps:.0f}%)"
        + (" warm-up" if warm_up else "")
        + ("" if loss is None else f" loss {loss:.4f}")
        + "".join(f" {name} {value:.4f}" for name, value in (extra or {}).items())
        + " | "
        + " | ".join(figure for figure in figures if figure)
    )
    max_logging.log(line)
    return line

"""Rewards for RL: the contract every reward function follows, the built-ins by name, and weighted scoring.

A reward function is any callable `fn(prompts, completions, answers) -> list[float]` over a batch: row i holds a
prompt, one completion sampled for it and that prompt's reference answer. It is batched so that a reward can share
work across rows (one call to a judge model, one parse of a reference shared by a group of samples). Configs name
rewards by string, a built-in or `package.module:function`, so a user reward is any importable function.

`RewardSet` scores a batch with several rewards, one weight each. A reward that fails must not quietly skew the
advantages of a batch, so by default a failure is a `RewardError` naming the reward, the row and the completion.
With on_error="zero" the row scores 0 for that reward and the failure is counted in `errors` instead, for long runs
where a rare crash in a user reward should be watched rather than end training.

A reward that hangs (a parser stuck on a runaway generation, a judge that never answers) must not stall training
either, so with a timeout each reward runs in a worker process of its own, which a call past the timeout is killed
with; that call, or a worker that dies, fails like a reward that raised.
"""

from collections.abc import Callable, Sequence
import atexit
import ctypes
import functools
import multiprocessing
from multiprocessing import connection as mp_connection
import os
import signal
import subprocess
import sys
import threading
import traceback

import numpy as np

from maxtext_posttrain import user_code
from maxtext_posttrain.rewards import math

RewardFn = Callable[[list[str], list[str], list[str]], list[float]]

BUILTINS: dict[str, RewardFn] = {"correctness": math.correctness, "format": math.format, "partial": math.partial}
ON_ERROR = ("raise", "zero")
_EXCERPT_CHARS = 200
_EXIT_WAIT_S = 1.0  # how long a worker process has to exit once asked to, before a harder signal
# How long a worker process may take to start (an interpreter, this package and the reward's module), however short
# the timeout of a call is.
_START_S = 60.0
_PR_SET_PDEATHSIG = 1  # prctl option: the signal the kernel sends a process when its parent dies
# What a worker process runs: the trainer's sys.path first (as multiprocessing's spawn does), so that this package and
# user reward modules import as they do in the trainer, then the serving loop.
_WORKER_MAIN = (
    "import sys; from multiprocessing.connection import Connection; connection = Connection(int(sys.argv[1])); "
    "sys.path[:], spec = connection.recv(); from maxtext_posttrain.rewards import _serve; "
    "_serve(connection, spec, int(sys.argv[2]))"
)


class RewardSpecError(ValueError):
  """Reward names that do not resolve to functions, or a reward set's arguments that do not fit; an error a user's
  reward module raises while it is imported is its own."""


class RewardError(RuntimeError):
  """A reward function failed or broke the contract: `function` is its spec, `row` the batch row (None: not one)."""

  def __init__(self, function: str, row: int | None, message: str):
    super().__init__(f"Reward {function!r}{'' if row is None else f' on row {row}'}: {message}")
    self.function = function
    self.row = row
    self.message = message

  def __reduce__(self):
    """Pickled by its arguments, so that a worker process can send one back."""
    return RewardError, (self.function, self.row, self.message)


class _WorkerFailure(Exception):
  """A call that failed in a reward's worker process (it raised, or the process died), worded as `_detail` words an
  exception raised in this process."""


class _Timeout(_WorkerFailure):
  """A call that ran past the timeout, whose worker process was killed."""


class _WorkerTraceback(Exception):
  """The traceback of an exception raised in a worker process, as text: the cause of the `_WorkerFailure` it made."""


def load(spec: str) -> RewardFn:
  """The reward function `spec` names: a built-in (see BUILTINS) or `package.module:function` on the Python path."""
  if spec in BUILTINS:
    return BUILTINS[spec]
  try:
    function = user_code.resolve(spec, f"one of {sorted(BUILTINS)} or 'package.module:function'")
  except user_code.NotFound as error:
    raise RewardSpecError(f"Reward {spec!r}: {error}.") from error
  if not callable(function):
    raise RewardSpecError(f"Reward {spec!r}: {spec.partition(':')[2]!r} is not callable ({type(function).__name__}).")
  return function


def _excerpt(text: str) -> str:
  """At most _EXCERPT_CHARS of `text`: its start and its end, where a final answer is."""
  if len(text) <= _EXCERPT_CHARS:
    return text
  half = (_EXCERPT_CHARS - 5) // 2
  return f"{text[:half]} ... {text[-half:]}"


def _detail(error: Exception) -> str:
  """How a failed call reads in a RewardError: `Type: message`, the same whether it failed here or in a worker."""
  if isinstance(error, _WorkerFailure):
    return str(error)
  return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _call(spec: str, function: RewardFn, prompts, completions, answers) -> np.ndarray:
  """The function's scores as float64 [N]; RewardError if they are not one number per completion."""
  scores = function(prompts, completions, answers)
  try:
    array = np.asarray(scores, dtype=np.float64)
  except (TypeError, ValueError) as error:
    raise RewardError(spec, None, f"returned {type(scores).__name__}, not a list of numbers") from error
  if array.shape != (len(completions),):
    raise RewardError(spec, None, f"returned scores of shape {array.shape} for {len(completions)} completions")
  return array


def _serve(connection: mp_connection.Connection, spec: str, trainer_pid: int) -> None:
  """A worker process's loop: answers each batch the trainer sends with the scores of the reward `spec` names (or
  what went wrong), until the trainer hangs up."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it then closes its workers
  # Killed with the trainer, even by SIGKILL in the middle of a call: never orphaned. (Strictly with the trainer's
  # thread that started it: one started by a thread that ends is started again on next use.)
  if sys.platform == "linux":
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  if os.getppid() != trainer_pid:  # the trainer died before the line above
    return
  function = load(spec)
  connection.send("ready")
  while True:
    try:
      prompts, completions, answers = connection.recv()
    except EOFError:
      return
    try:
      reply = ("scores", _call(spec, function, prompts, completions, answers))
    except RewardError as error:
      reply = ("broke", error)
    except Exception as error:  # pylint: disable=broad-exception-caught
      reply = ("raised", _detail(error), traceback.format_exc())
    connection.send(reply)


class _Worker:
  """Calls one reward function in a process of its own, started on first use and replaced after one that dies or
  overruns a call's timeout (which is killed).

  The process is a fresh interpreter, not a fork of the trainer (whose JAX threads a fork would copy mid-flight),
  nor multiprocessing's spawn (which imports the trainer's `__main__` again: MaxText and JAX, seconds per worker). It
  loads the function by its spec, so a call sends the rows and gets back the scores, one round trip.
  """

  def __init__(self, spec: str):
    self.spec = spec
    self._process: subprocess.Popen | None = None
    self._connection: mp_connection.Connection | None = None
    self._lock = threading.Lock()  # one call at a time on the connection

  def __call__(self, prompts, completions, answers, timeout: float) -> np.ndarray:
    with self._lock:
      try:
        if self._process is None or self._process.poll() is not None:  # not started yet, or died between calls
          self._start(timeout)
        self._connection.send((prompts, completions, answers))
        reply = self._reply(timeout)
      except (EOFError, OSError) as error:
        raise _WorkerFailure(f"its worker process died (exit code {self.close()})") from error
    if reply[0] == "broke":
      raise reply[1]
    if reply[0] == "raised":
      raise _WorkerFailure(reply[1]) from _WorkerTraceback(reply[2])
    return reply[1]

  def _start(self, timeout: float) -> None:
    """Starts a worker process and waits until it has loaded the function, so that a call's time is the call's."""
    self.close()
    self._connection, child = multiprocessing.Pipe()
    with child:
      self._process = subprocess.Popen(
          [sys.executable, "-c", _WORKER_MAIN, str(child.fileno()), str(os.getpid())],
          pass_fds=[child.fileno()],
          stdin=subprocess.DEVNULL,
      )
    self._connection.send((sys.path, self.spec))
    self._reply(max(timeout, _START_S), " starting its worker process")

  def _reply(self, timeout: float, doing: str = ""):
    """The worker's next message; _Timeout, with the worker killed, if none comes within `timeout` seconds."""
    if not self._connection.poll(timeout):
      self.close(wait_s=0)
      raise _Timeout(f"timed out after {timeout:g} s{doing}")
    return self._connection.recv()

  def close(self, wait_s: float = _EXIT_WAIT_S) -> int | None:
    """Ends the worker process, if one runs, and gives its exit code. An idle worker exits within `wait_s` of its
    connection closing; one still in a call (wait_s=0 for a hung one) gets SIGTERM, then SIGKILL."""
    process, self._process = self._process, None
    if process is None:
      return None
    self._connection.close()
    try:
      return process.wait(wait_s)
    except subprocess.TimeoutExpired:
      process.terminate()
    try:
      return process.wait(_EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
      process.kill()
      return process.wait()


# One worker per reward spec in a process, shared by its reward sets (a run's, an evaluation's): a worker costs an
# interpreter and its imports (math-verify, sympy: about a second) to start.
_WORKERS: dict[str, _Worker] = {}


def _worker(spec: str) -> _Worker:
  if spec not in _WORKERS:
    _WORKERS[spec] = _Worker(spec)
  return _WORKERS[spec]


@atexit.register
def _close_workers() -> None:
  for worker in _WORKERS.values():
    worker.close()


class RewardSet:
  """Named reward functions with one weight each; `score` gives their weighted sum per row.

  on_error="raise" (default) turns a reward that raises or returns a non-finite score into a RewardError naming the
  reward, the row and an excerpt of the completion; on_error="zero" scores that row 0 for that reward and counts it
  in `errors` (per reward, over the life of the set). A batched call that raises is repeated row by row to find
  the failing rows; under on_error="raise", a batch that fails where no row alone does is a RewardError too.
  Returning the wrong number of scores breaks the contract rather than failing on a row, and raises either way.

  With timeout_seconds > 0 each reward is called in a worker process of its own (see `_Worker`), which a call that
  takes longer is killed with: that call fails, and so does one whose worker dies (a segfault, `os._exit`), like a
  reward that raised. A call that timed out is not repeated row by row, where a hang could cost the timeout once
  per row: under on_error="raise" it is a RewardError (row None for the batched call), under "zero" all its rows
  score 0 and are counted. A worker that died is repeated row by row, like an exception, to find the row that
  kills it. With 0 the rewards are called in this process, without a limit. The reward sets of a process share one
  worker per reward; `close` (or the interpreter's exit) ends those of this set's rewards.
  """

  def __init__(
      self, names: Sequence[str], weights: Sequence[float], on_error: str = "raise", timeout_seconds: float = 0.0
  ):
    names, weights = list(names), [float(weight) for weight in weights]
    if len(names) != len(weights):
      raise RewardSpecError(f"Rewards {names} and weights {weights} differ in length: each reward needs one weight.")
    if not names:
      raise RewardSpecError("A RewardSet needs at least one reward.")
    if len(set(names)) != len(names):
      raise RewardSpecError(f"Rewards {names} name a reward twice.")
    if on_error not in ON_ERROR:
      raise RewardSpecError(f"on_error={on_error!r}: expected one of {ON_ERROR}.")
    if timeout_seconds < 0:
      raise RewardSpecError(f"timeout_seconds={timeout_seconds}: expected > 0 seconds, or 0 for no limit.")
    self.names, self.weights, self.on_error = names, weights, on_error
    self.functions = [load(name) for name in names]  # loaded here too, so that a bad spec fails at once
    self.errors = dict.fromkeys(names, 0)
    if timeout_seconds > 0:
      self._workers = [_worker(name) for name in names]
      self._calls = [functools.partial(worker, timeout=timeout_seconds) for worker in self._workers]
    else:
      self._workers = []
      self._calls = [functools.partial(_call, name, function) for name, function in zip(names, self.functions)]

  def close(self) -> None:
    """Ends the worker processes of this set's rewards, if any; a later `score` starts them again."""
    for worker in self._workers:
      worker.close()

  def score(self, prompts: list[str], completions: list[str], answers: list[str]):
    """(total float32 [N], {name: float32 [N]}): the weighted sum over rewards and each reward's scores."""
    if not len(prompts) == len(completions) == len(answers):
      raise ValueError(f"{len(prompts)} prompts, {len(completions)} completions and {len(answers)} answers differ.")
    per_function = {
        name: self._scores(name, call, prompts, completions, answers) for name, call in zip(self.names, self._calls)
    }
    total = np.zeros(len(completions), np.float32)
    for name, weight in zip(self.names, self.weights):
      total += np.float32(weight) * per_function[name]
    return total, per_function

  def _scores(self, name, call, prompts, completions, answers) -> np.ndarray:
    try:
      scores = call(prompts, completions, answers)
    except RewardError:
      raise
    except _Timeout as timeout:
      if self.on_error == "raise":
        raise RewardError(
            name, None, f"{timeout}; a call on {len(completions)} rows, not retried row by row"
        ) from timeout
      self.errors[name] += len(completions)
      scores = np.zeros(len(completions))
    except Exception as batch_error:  # pylint: disable=broad-exception-caught
      # The batched call does not say which row failed: score the rows alone to find out. Under on_error="raise"
      # a failing row raises here, so getting past the rows means the batch fails where no row does.
      scores = np.array([self._row_score(name, call, row, prompts, completions, answers) for row in range(len(prompts))])
      if self.on_error == "raise":
        raise RewardError(name, None, f"failed on the batch but on no row alone: {_detail(batch_error)}") from batch_error
    for row in np.flatnonzero(~np.isfinite(scores)):
      scores[row] = self._failed(name, int(row), completions[row], f"returned {scores[row]}")
    return scores.astype(np.float32)

  def _row_score(self, name, call, row, prompts, completions, answers) -> float:
    try:
      return call([prompts[row]], [completions[row]], [answers[row]])[0]
    except RewardError:
      raise
    except Exception as error:  # pylint: disable=broad-exception-caught
      return self._failed(name, row, completions[row], _detail(error), error)

  def _failed(self, name: str, row: int, completion: str, detail: str, cause: Exception | None = None) -> float:
    """0.0 for a failed row, counted, under on_error="zero"; a RewardError otherwise."""
    if self.on_error == "zero":
      self.errors[name] += 1
      return 0.0
    raise RewardError(name, row, f"{detail}; completion: {_excerpt(completion)!r}") from cause

"""`python -m maxtext_posttrain.train` that SIGKILLs itself at one chosen moment: the launcher of the reliability
drills (benchmarks/drills.py, tests/test_drills.py).

  python -m tests.drill_hooks <moment> <step> <delay> <kill_log> -- <config.yml> key=value ...

runs the training command after the arguments' `--` and kills the process at <moment> of training step <step>:

  step      <delay> seconds after the step's train step is called, from a timer thread, wherever the loop is then
            (the step's device work, its metrics, its checkpoint save or the next step);
  rollout   <delay> seconds after the step's rollouts are dispatched to the sampler (RL), from the main thread,
            while the decode program runs on the devices;
  write     <delay> seconds into the background write of the step's checkpoint, from orbax's save thread, before
            the commit (when the writes take less, once they are done);
  commit    in the commit of the step's checkpoint, just before orbax renames its complete temporary directory to
            the step's directory;
  renamed   just after that rename, before orbax's save thread reports the save done.

Checkpoint moments are those of the primary role's checkpoints (`<run>/checkpoints`). Just before the kill the
process appends one JSON line to <kill_log>: the moment, its step and delay, where it landed and the killing thread.

A drill needs moments that an outside signal would hit only by chance (a checkpoint write of a tiny model takes
milliseconds), hence a kill from inside; the wrappers that place it live here, and nothing in the package knows of
them.
"""

import json
import os
import signal
import sys
import threading
import time

from etils import epath
from orbax.checkpoint._src.checkpointers import async_checkpointer
from orbax.checkpoint._src.futures import future
from orbax.checkpoint._src.path import async_path

from maxtext_posttrain import cli
from maxtext_posttrain import train
from maxtext_posttrain import trainer
from maxtext_posttrain.rollout import sampler as sampler_lib

# The wrappers replace private functions of the trainer and of orbax: the moments a drill needs have no public hook.
# pylint: disable=protected-access

MOMENTS = ("step", "rollout", "write", "commit", "renamed")
PACKAGE_DIR = os.path.dirname(trainer.__file__)


def _main_thread_at() -> str:
  """`module.function` of the main thread's innermost frame in this package: where a kill from another thread
  found the loop."""
  frame = sys._current_frames().get(threading.main_thread().ident)
  while frame is not None and not frame.f_code.co_filename.startswith(PACKAGE_DIR):
    frame = frame.f_back
  if frame is None:
    return "outside the package"
  module = os.path.relpath(frame.f_code.co_filename, PACKAGE_DIR).removesuffix(".py").replace(os.sep, ".")
  return f"{module}.{frame.f_code.co_name}"


class Drill:
  """One kill, armed by wrapping the trainer's step, the sampler's dispatch and orbax's checkpoint write."""

  def __init__(self, moment: str, step: int, delay: float, kill_log: str):
    if moment not in MOMENTS:
      raise ValueError(f"Unknown moment {moment!r}; the moments are {MOMENTS}.")
    self.moment, self.step, self.delay, self.kill_log = moment, step, delay, kill_log
    self.loop = None

  def kill(self, landed: str) -> None:
    record = {"moment": self.moment, "step": self.step, "delay": self.delay, "landed": landed}
    record |= {"loop_step": self.loop.step, "thread": threading.current_thread().name}
    with open(self.kill_log, "a", encoding="utf-8") as f:
      f.write(json.dumps(record) + "\n")
    os.kill(os.getpid(), signal.SIGKILL)

  def _is_checkpoint(self, directory) -> bool:
    """Whether `directory` is the primary role's checkpoint of the drill's step."""
    return epath.Path(directory) == epath.Path(self.loop.primary.config.checkpoint_dir) / str(self.step)

  def install(self) -> None:
    setup, train_step, start = trainer.setup, trainer._train_step, sampler_lib.Sampler.start
    wait_for_writes, rename = async_checkpointer._background_wait_for_commit_futures, async_path.rename

    def kept_setup(config):
      self.loop = setup(config)
      return self.loop

    def timed_train_step(loop, batch):
      if self.moment == "step" and loop.step == self.step:
        timer = threading.Timer(self.delay, lambda: self.kill(f"main thread in {_main_thread_at()}"))
        timer.daemon = True
        timer.start()
      return train_step(loop, batch)

    def start_then_kill(sampler, *args, **kwargs):
      pending = start(sampler, *args, **kwargs)
      if self.moment == "rollout" and self.loop.step == self.step:
        time.sleep(self.delay)
        self.kill("decoding" if not all(x.is_ready() for x in pending.outputs) else "decoded, not yet read")
      return pending

    def write_then_kill(directory, commit_futures, on_commit_callback, **kwargs):
      if self.moment == "write" and self._is_checkpoint(directory):
        written = threading.Event()

        def wait():
          future.ChainedFuture(commit_futures, cb=lambda: None).result()
          written.set()

        threading.Thread(target=wait, daemon=True).start()
        self.kill("written, not committed" if written.wait(self.delay) else "writing")
      return wait_for_writes(directory, commit_futures, on_commit_callback, **kwargs)

    async def rename_with_kill(source, destination):
      if self.moment == "commit" and self._is_checkpoint(destination):
        self.kill("complete, not yet renamed")
      renamed = await rename(source, destination)
      if self.moment == "renamed" and self._is_checkpoint(destination):
        self.kill("renamed, save not yet reported")
      return renamed

    trainer.setup, trainer._train_step, sampler_lib.Sampler.start = kept_setup, timed_train_step, start_then_kill
    async_checkpointer._background_wait_for_commit_futures = write_then_kill
    async_path.rename = rename_with_kill


def main(argv: list[str]) -> None:
  separator = argv.index("--")
  moment, step, delay, kill_log = argv[1:separator]
  Drill(moment, int(step), float(delay), kill_log).install()
  sys.argv = [argv[0], *argv[separator + 1 :]]
  cli.run(train.main)


if __name__ == "__main__":
  main(sys.argv)

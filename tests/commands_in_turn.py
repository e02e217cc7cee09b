"""Command lines of `python -m maxtext_posttrain.train`, one after another in one interpreter: run by
tests/test_cli.py, which checks how each ends without paying a fresh interpreter's start-up (seconds of MaxText's
imports) for each.

  python -m tests.commands_in_turn '<JSON list of argument lists>'

Each runs the module as `python -m` does (runpy, as `__main__`, so its spec names the command in the error line) to the
SystemExit it ends in. The last line printed is JSON: per command line, the exit status the interpreter would give and
what it wrote to stderr, the exit message last as the interpreter prints it.
"""

import contextlib
import io
import json
import runpy
import sys


def run(args: list[str]) -> dict:
  sys.argv = ["maxtext_posttrain.train", *args]
  stderr = io.StringIO()
  code = 0
  with contextlib.redirect_stderr(stderr):
    try:
      runpy.run_module("maxtext_posttrain.train", run_name="__main__", alter_sys=True)
    except SystemExit as exited:
      code = exited.code
  if isinstance(code, str):  # sys.exit(message): the interpreter prints it and exits with status 1
    return {"returncode": 1, "stderr": f"{stderr.getvalue()}{code}\n"}
  return {"returncode": code or 0, "stderr": stderr.getvalue()}


if __name__ == "__main__":
  print(json.dumps([run(args) for args in json.loads(sys.argv[1])]))

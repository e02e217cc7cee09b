"""Runs tests/test_sharding.py's sharded runs in one subprocess with 4 fake CPU devices, one after another.

  XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/on_four_devices.py \\
      '[["<name>", "tests.multidevice_rl", "run", [<args>]], ...]'

Each job calls `<module>.<function>(*args)` and prints one JSON line, {"job": name, "result": <what it returned>}, or
{"job": name, "error": <traceback>} if it raised, so that one failing job fails its own test only. Starting a
process costs 11-37 s on the 2-core test machine, depending on the hour (Python importing MaxText's modules, then
tearing them down), more than most of these runs: one process runs them all.
"""

import importlib
import json
import sys
import traceback


def main(argv: list[str]) -> None:
  for name, module, function, args in json.loads(argv[1]):
    try:
      line = {"job": name, "result": getattr(importlib.import_module(module), function)(*args)}
    except Exception:  # pylint: disable=broad-exception-caught
      line = {"job": name, "error": traceback.format_exc()}
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
  main(sys.argv)

"""Several runs in one process, one after another: run by tests/test_multiprocess.py, alone or under
scripts/launch_local.sh.

  python -m tests.train_in_turn <config.yml> key=value ... [:: <config.yml> key=value ...] [:: @<module> arg ...]

Each run is `maxtext_posttrain.train.main` on its own argv, the function `python -m maxtext_posttrain.train` runs; a
group that starts with `@<module>` (not `-m`, which absl would read as a flag) is that module's `main` on the rest of
the group: the probes, tests/multiprocess_data.py and tests/multiprocess_scoring.py.
Starting a process costs 11-37 s on the 2-core test machine, depending on the hour (Python importing MaxText's
modules, then tearing them down), more than a few-step run itself: each process of a job pays it once for all its
runs.
"""

import importlib
import itertools

from maxtext_posttrain import cli
from maxtext_posttrain import train

SEPARATOR = "::"  # absl takes `--` for itself


def main(argv: list[str]) -> None:
  for is_separator, group in itertools.groupby(argv[1:], lambda arg: arg == SEPARATOR):
    if is_separator:
      continue
    group = list(group)
    if group[0].startswith("@"):
      importlib.import_module(group[0][1:]).main(["", *group[1:]])
    else:
      train.main(["", *group])


if __name__ == "__main__":
  cli.run(main)

"""Several training runs in one process, one after another: run by tests/test_multiprocess.py, alone or under
scripts/launch_local.sh.

  python -m tests.train_in_turn <config.yml> key=value ... [:: <config.yml> key=value ...]

Each run is `maxtext_posttrain.train.main` on its own argv, the function `python -m maxtext_posttrain.train` runs.
Starting a process costs about 25 s of CPU on the 2-core test machine (Python importing MaxText's modules, then
tearing them down), more than a few-step run itself: each process of a job pays it once for all its runs.
"""

from maxtext_posttrain import cli
from maxtext_posttrain import train

SEPARATOR = "::"  # absl takes `--` for itself


def main(argv: list[str]) -> None:
  for group in " ".join(argv[1:]).split(f" {SEPARATOR} "):
    train.main(["", *group.split()])


if __name__ == "__main__":
  cli.run(main)

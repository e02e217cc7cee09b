"""Entry point: `python -m maxtext_posttrain.train <config.yml> key=value ...`, argv as in MaxText's train.py.

Accepts MaxText's own base.yml (or any yml whose `base_config:` chain reaches it) plus `posttrain_mode=<name>`,
so a MaxText launcher such as xpk runs post-training by swapping the module name.
"""

from typing import Sequence


from maxtext.utils import max_logging
from maxtext.utils import max_utils

from maxtext_posttrain import cli
from maxtext_posttrain import config as posttrain_config
from maxtext_posttrain import trainer


def main(argv: Sequence[str]) -> None:
  config = posttrain_config.initialize(list(argv))
  max_utils.print_system_information()
  loop = trainer.setup(config)
  summary = trainer.train(loop)
  start, end = summary["start_step"], summary["end_step"]
  trained = f"trained steps {start}..{end - 1}" if end > start else f"no steps left to train (steps={config.steps})"
  max_logging.log(f"Finished {config.run_name}: {trained}")


if __name__ == "__main__":
  cli.run(main)

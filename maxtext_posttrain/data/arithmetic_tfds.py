"""TFDS builders for the bundled arithmetic word problems and their preference pairs.

Exposing the generator as a TFDS dataset gives it TFDS's versioning, split metadata and on-disk layout, and lets the
pipeline read it like any other prepared TFDS dataset: written as ArrayRecord and read through grain with
`tfds.data_source`, so neither building nor reading needs TensorFlow. Building is offline (nothing is downloaded) and
takes about a second, so it happens on first use.
"""

import dataclasses

from etils import epath
import jax
from jax.experimental import multihost_utils
import tensorflow_datasets as tfds

from maxtext.utils import max_logging
from maxtext_posttrain.data import arithmetic

NAME = "arithmetic_word_problems"
FILE_FORMAT = "array_record"  # random access through grain, without TensorFlow


@dataclasses.dataclass
class ArithmeticConfig(tfds.core.BuilderConfig):
  """A difficulty level (a key of `arithmetic.DIFFICULTIES`) and the size and seed of each split."""

  difficulty: str = "easy"
  num_train: int = 20000
  num_test: int = 500
  seed: int = 0
  calculator: bool = False  # steps annotated for GSM8K's calculator (`<<28*9=252>>`)


class ArithmeticWordProblems(tfds.core.GeneratorBasedBuilder):
  """Arithmetic word problems with GSM8K-style worked answers (`... #### <number>`)."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}
  BUILDER_CONFIGS = [
      ArithmeticConfig(name="easy", description="One + or - step, operands 1..9, non-negative results."),
      ArithmeticConfig(name="medium", difficulty="medium", description="Two + / - steps, operands up to 20."),
      ArithmeticConfig(name="hard", difficulty="hard", description="Two or three steps including *, operands up to 50."),
      ArithmeticConfig(
          name="hard_calculator",
          difficulty="hard",
          calculator=True,
          description="The hard problems, each step annotated for GSM8K's calculator: 28 * 9 = <<28*9=252>>252.",
      ),
  ]

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    # TFDS 4.9.10 derives this through `importlib_resources`, which it only installs on Python < 3.9.
    return epath.Path(__file__)

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description=__doc__,
        features=tfds.features.FeaturesDict({"question": tfds.features.Text(), "answer": tfds.features.Text()}),
        supervised_keys=("question", "answer"),
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # everything is generated locally
    return {
        "train": self._generate_examples("train", self.builder_config.num_train),
        "test": self._generate_examples("test", self.builder_config.num_test),
    }

  def _generate_examples(self, split, num_examples):
    config = self.builder_config
    examples = arithmetic.generate(config.difficulty, split, num_examples, config.seed, config.calculator)
    for index, example in enumerate(examples):
      yield index, example


class ArithmeticPreferences(tfds.core.GeneratorBasedBuilder):
  """The arithmetic word problems as preference pairs: the worked solution (`chosen`) against a plausible wrong one
  (`rejected`); the same questions and splits as `arithmetic_word_problems` with the same config."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}
  BUILDER_CONFIGS = [
      ArithmeticConfig(name=c.name, difficulty=c.difficulty, description=c.description)
      for c in ArithmeticWordProblems.BUILDER_CONFIGS
      if not c.calculator  # the pairs' wrong solutions are written without annotations
  ]

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    return epath.Path(__file__)

  def _info(self) -> tfds.core.DatasetInfo:
    text = tfds.features.Text()
    return tfds.core.DatasetInfo(
        builder=self,
        description=self.__doc__,
        features=tfds.features.FeaturesDict({"question": text, "chosen": text, "rejected": text}),
    )

  def _split_generators(self, dl_manager):
    del dl_manager
    return {
        "train": self._generate_examples("train", self.builder_config.num_train),
        "test": self._generate_examples("test", self.builder_config.num_test),
    }

  def _generate_examples(self, split, num_examples):
    config = self.builder_config
    pairs = arithmetic.generate_preferences(config.difficulty, split, num_examples, config.seed)
    for index, example in enumerate(pairs):
      yield index, example


def prepare(name: str, data_dir: str) -> tfds.core.DatasetBuilder:
  """The TFDS builder `name` (`builder/config[:version]`) in `data_dir`, built there first if it is missing.

  Process 0 builds while the others wait, so hosts sharing a data_dir never write it concurrently.
  """
  builder = tfds.builder(name, data_dir=data_dir, file_format=FILE_FORMAT)
  if not builder.is_prepared() and jax.process_index() == 0:
    max_logging.log(f"Building TFDS dataset {name} into {builder.data_dir} (first use).")
    tfds.disable_progress_bar()
    builder.download_and_prepare()
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(f"prepared {name}")
    builder = tfds.builder(name, data_dir=data_dir, file_format=FILE_FORMAT)
  return builder

"""Builds the small sentencepiece tokenizer bundled at maxtext_posttrain/assets/arithmetic.model.

A 512-piece vocabulary keeps the embedding and softmax tiny, so CPU runs are fast, and single-digit pieces make
arithmetic learnable (a model never has to memorise multi-digit tokens). The model is trained on the bundled
arithmetic problems (all difficulties) plus GSM8K train (`--gsm8k ""` leaves it out, which gives another model),
single-threaded with a fixed seed, so a rebuild reproduces the committed file byte for byte. Special ids follow what MaxText's SentencePieceTokenizer reads
from the model: pad=0 (MaxText pads with it), unk=1, bos=2, eos=3.

  python scripts/build_tokenizer.py [--output PATH] [--gsm8k PATH] [--vocab_size N]   # after `pip install -e .`
"""

import argparse
import io
import json
import os

import sentencepiece as spm

from maxtext_posttrain.data import arithmetic
from maxtext_posttrain.data import arithmetic_tfds
from maxtext.utils import max_logging

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DEFAULT_OUTPUT = os.path.join(_REPO, "maxtext_posttrain", "assets", "arithmetic.model")
_DEFAULT_GSM8K = os.path.join(_REPO, "..", "shared", "data", "gsm8k", "train.jsonl")
_SEED = 0


def _arithmetic_text() -> list[str]:
  """Question and answer text of every bundled train split, in a fixed order."""
  lines = []
  for config in arithmetic_tfds.ArithmeticWordProblems.BUILDER_CONFIGS:
    if config.calculator:  # the same problems as its difficulty's; the tokenizer predates the annotated set
      continue
    for example in arithmetic.generate(config.difficulty, "train", config.num_train, config.seed):
      lines += [example["question"], example["answer"]]
  return lines


def _gsm8k_text(path: str) -> list[str]:
  if not path:
    max_logging.log("Training the tokenizer on the arithmetic problems only (--gsm8k is empty).")
    return []
  with open(path, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return [text for row in rows for text in (row["question"], row["answer"])]


def train(texts: list[str], vocab_size: int) -> bytes:
  """Trains the model on `texts` and returns its serialized bytes."""
  spm.set_random_generator_seed(_SEED)
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(texts),
      model_writer=model,
      model_type="bpe",
      vocab_size=vocab_size,
      character_coverage=1.0,
      split_digits=True,
      byte_fallback=False,
      normalization_rule_name="identity",  # keep newlines and spacing, so `#### n` lines survive a round trip
      remove_extra_whitespaces=False,
      user_defined_symbols=["\n"],
      pad_id=0,
      unk_id=1,
      bos_id=2,
      eos_id=3,
      input_sentence_size=0,  # use every sentence: no sampling
      shuffle_input_sentence=False,
      num_threads=1,
      max_sentence_length=1 << 16,
      minloglevel=2,
  )
  return model.getvalue()


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--output", default=_DEFAULT_OUTPUT)
  parser.add_argument("--gsm8k", default=_DEFAULT_GSM8K)
  parser.add_argument("--vocab_size", type=int, default=512)
  args = parser.parse_args()
  model = train(_arithmetic_text() + _gsm8k_text(args.gsm8k), args.vocab_size)
  with open(args.output, "wb") as f:
    f.write(model)
  max_logging.log(f"Wrote {args.output} ({len(model)} bytes, vocab {args.vocab_size}).")


if __name__ == "__main__":
  main()

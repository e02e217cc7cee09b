"""Entry point: `python -m maxtext_posttrain.score_teacher <distill config> offline_data_dir=<dir> distill.top_k=<k> ...`
writes a teacher's top-k distribution over a dataset, which `posttrain_mode=distill` then reads from the same
`offline_data_dir` instead of running the teacher.

Give it the distillation run's own config and keys (the teacher is the yml plus `teacher_overrides`, as in
training; the data, tokenizer and `distill_temperature` are the run's): the files are tied to the run's tokenized
splits by fingerprint, and a run with other data, tokenizer, k or temperature refuses them at start. Each example
is scored alone (its own row, positions from 0), which is what the teacher sees of it in a packed batch, whose
segment ids keep examples apart; `data.teacher_logits` describes the files. The train split is always scored,
the eval split when `eval_interval > 0` (the held-out loss reads it too).
"""

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from maxtext.utils import max_logging
from maxtext_posttrain import cli
from maxtext_posttrain import config as posttrain_config
from maxtext_posttrain import forward
from maxtext_posttrain import mesh as mesh_lib
from maxtext_posttrain import roles
from maxtext_posttrain.data import pipeline
from maxtext_posttrain.data import teacher_logits
from maxtext_posttrain.losses import distillation


def _rows(examples: list[dict], length: int, pad_id: int) -> dict[str, np.ndarray]:
  """Unpacked rows of `length`: each example from position 0, segment 1, padding after it; `scored` marks the
  positions whose teacher distribution the files keep (`teacher_logits.scored_positions`)."""
  inputs = np.full((len(examples), length), pad_id, np.int32)
  segmentation, scored = np.zeros((len(examples), length), np.int32), np.zeros((len(examples), length), np.int8)
  for row, example in enumerate(examples):
    tokens = example["inputs"]
    inputs[row, : len(tokens)], segmentation[row, : len(tokens)] = tokens, 1
    scored[row, teacher_logits.scored_positions(tokens, example["targets"], pad_id)] = 1
  positions = np.where(segmentation != 0, np.arange(length, dtype=np.int32), 0)
  return {"inputs": inputs, "positions": positions, "segmentation": segmentation, "scored": scored}


def score_split(teacher: roles.FrozenModel, examples: pipeline.TokenizedExamples, config, writer, pad_id, label):
  """Writes `examples`' records through `writer`, in order, scoring `global_batch_size_to_train_on` rows a call.
  Each process tokenizes its block of each call's rows; process 0 writes every record from the gathered outputs
  (the rows' lengths and scored positions travel with the teacher's). The rows take the teacher's input data
  sharding (its config: the yml plus teacher_overrides), the layout its programs run under."""
  k, temperature = posttrain_config.distill(config).top_k, np.float32(config.distill_temperature)

  def top_k(model, batch, temperature):
    logits = forward.logits(model, batch["inputs"], batch["positions"], batch["segmentation"])
    return *distillation.teacher_top_k(logits, k, temperature), jnp.sum(batch["segmentation"], axis=-1), batch["scored"]

  rows_per_call, length = config.global_batch_size_to_train_on, config.max_target_length
  rows_at = lambda indices: _rows([examples[i] for i in indices], length, pad_id)
  calls = teacher.run_over_rows(top_k, len(examples), rows_at, rows_per_call, temperature, label=label)
  for _, (ids, logprobs, log_rest, lengths, scored) in calls:
    if jax.process_index() == 0:
      for row in range(len(ids)):
        kept = np.flatnonzero(scored[row]).astype(np.int32)
        writer.write(int(lengths[row]), kept, ids[row, kept], logprobs[row, kept], log_rest[row, kept])


def score(config) -> teacher_logits.Metadata:
  """Scores the run's splits with its teacher into `config.offline_data_dir`; returns the metadata written."""
  directory, k = config.offline_data_dir, posttrain_config.distill(config).top_k
  if config.posttrain_mode != "distill":
    raise ValueError(f"score_teacher scores for posttrain_mode=distill, got posttrain_mode={config.posttrain_mode}.")
  if not directory:
    raise ValueError("score_teacher writes to offline_data_dir: set offline_data_dir=<directory>.")
  if not 1 <= k <= config.vocab_size:
    raise ValueError(f"distill.top_k={k}: offline files keep the teacher's top k tokens; set 1 <= k <= vocab_size.")
  if config.distill_temperature_end not in (None, config.distill_temperature):
    raise ValueError(
        f"distill_temperature_end={config.distill_temperature_end}: offline files hold the teacher at one "
        f"temperature (distill_temperature={config.distill_temperature}); a temperature schedule needs the online teacher."
    )
  mesh = mesh_lib.make_mesh(config)
  teacher = roles.build_frozen(roles.teacher(config, "score_teacher"), config, mesh)
  encoder = pipeline.Encoder.from_config(config)
  splits = {}
  for split, train in (("train", True), ("eval", False)):
    if not train and config.eval_interval <= 0:
      continue
    examples, stats = pipeline.prepare_split(config, train, encoder)
    writer = teacher_logits.Writer(directory, split) if jax.process_index() == 0 else None
    score_split(teacher, examples, config, writer, encoder.pad_id, f"score {split}")
    if writer is not None:
      splits[split] = {
          "fingerprint": stats.fingerprint,
          "source": stats.source,
          "num_examples": len(examples),
          "num_scored_tokens": writer.num_scored_tokens,
          "bytes": writer.close(),
      }
  metadata = teacher_logits.Metadata(
      top_k=k,
      temperature=float(config.distill_temperature),
      vocab_size=config.vocab_size,
      tokenizer_path=config.tokenizer_path,
      tokenizer_digest=teacher_logits.tokenizer_digest(config),
      teacher=teacher.config.load_parameters_path,
      splits=splits,
  )
  if jax.process_index() == 0:
    metadata.write(directory)
    for split in splits:
      max_logging.log(
          f"score_teacher: {split}: {splits[split]['num_scored_tokens']} tokens, "
          f"{metadata.bytes_per_token(split):.1f} bytes/token, in {teacher_logits.split_file(directory, split)}"
      )
  return metadata


def main(argv: Sequence[str]) -> None:
  score(posttrain_config.initialize(list(argv)))


if __name__ == "__main__":
  cli.run(main)

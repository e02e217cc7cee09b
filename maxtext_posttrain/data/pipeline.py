"""The SFT input pipeline: records -> prompt template -> tokens -> MaxText batches, as global sharded arrays.

Everything after tokenization is MaxText's own grain code, so batches look exactly like MaxText SFT batches
(`inputs`, `targets` and their `_segmentation`/`_position`), packing and the next-token shift behave the same, and
MaxText's checkpointing saves and restores the iterator (dataset_type=grain): a resumed run continues with the same
data order. Prompt tokens are masked the way MaxText's `SFTPromptMasking` masks them (target = pad id, which
`ShiftData` turns into targets_segmentation 0).

Each split gets a setup pass (`split_pass`: every process tokenizes its block of the examples, and all share the
outcome), which buys three things: overlong examples are truncated or rejected with their index, examples with no
completion left are dropped before they can make an all-masked row, and every split gets counts and a fingerprint
(sha256 of its tokens) for the run manifest. Batches tokenize their examples again when grain reads them.
"""

import dataclasses
import functools
import hashlib

import grain.python as grain
import jax
import numpy as np

from maxtext.input_pipeline import data_processing_utils
from maxtext.input_pipeline import input_pipeline_interface
from maxtext.input_pipeline import input_pipeline_utils
from maxtext.input_pipeline import multihost_dataloading
from maxtext.input_pipeline import tokenizer as maxtext_tokenizer
from maxtext.utils import max_logging
from maxtext.utils import sharding as maxtext_sharding
from maxtext_posttrain import config as config_lib
from maxtext_posttrain.data import sources
from maxtext_posttrain.data import split_pass


@dataclasses.dataclass(frozen=True)
class SplitStats:
  """What one split's tokenization pass found; `fingerprint` is sha256 over its tokenized examples in source order."""

  source: str
  num_examples: int  # rows in the source
  num_truncated: int  # kept, cut to max_target_length
  num_skipped: int  # dropped: no completion token left to learn from
  num_tokens: int  # input tokens of the kept examples
  num_target_tokens: int  # loss-bearing target tokens of the kept examples
  fingerprint: str


@dataclasses.dataclass(frozen=True)
class DataStats:
  """Per-split statistics, logged by the trainer and written to the run manifest."""

  train: SplitStats
  eval: SplitStats | None

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Encoder:
  """Applies the prompt template and tokenizes prompt and completion the way training and decoding both see them."""

  tokenizer: object
  pad_id: int
  prompt_template: str
  bos_id: int | None
  eos_id: int | None

  @classmethod
  def from_config(cls, config) -> "Encoder":
    # bos/eos are added here, once per example (prompt start, completion end), not once per text piece.
    tokenizer, pad_id = data_processing_utils.get_tokenizer_and_pad_id(config, add_bos=False, add_eos=False)
    return cls(
        tokenizer=tokenizer,
        pad_id=pad_id,
        prompt_template=config.prompt_template,
        bos_id=tokenizer.bos_id if config.add_bos else None,
        eos_id=tokenizer.eos_id if config.add_eos else None,
    )

  def prompt_text(self, prompt: str) -> str:
    return self.prompt_template.format(prompt=prompt)

  def prompt_ids(self, prompt: str) -> list[int]:
    return ([self.bos_id] if self.bos_id is not None else []) + list(self.tokenizer.encode(self.prompt_text(prompt)))

  def completion_ids(self, completion: str) -> list[int]:
    return list(self.tokenizer.encode(completion)) + ([self.eos_id] if self.eos_id is not None else [])

  def decode_completion(self, ids) -> str:
    """The text of generated tokens, without the EOS token that ended them."""
    return self.tokenizer.decode([t for t in ids if t != self.tokenizer.eos_id])

  @property
  def num_pieces(self) -> int:
    """How many ids the tokenizer decodes (0 .. num_pieces - 1).

    MaxText configs pad `vocab_size` past the tokenizer (here a 512-piece tokenizer under any larger embedding), and
    decoding a padding id fails (sentencepiece: OUT_OF_RANGE), so the sampler never draws one
    (`losses.logprobs.mask_undecodable`). Each of MaxText's tokenizer classes counts its pieces differently.
    """
    if isinstance(self.tokenizer, maxtext_tokenizer.SentencePieceTokenizer):
      return self.tokenizer._tokenizer_model.vocab_size()  # pylint: disable=protected-access
    if isinstance(self.tokenizer, maxtext_tokenizer.TikTokenTokenizer):
      return self.tokenizer.n_words
    if isinstance(self.tokenizer, maxtext_tokenizer.HFTokenizer):
      return len(self.tokenizer.tokenizer)  # with its added tokens
    raise TypeError(f"Cannot count the pieces of a {type(self.tokenizer).__name__}.")


@dataclasses.dataclass(frozen=True)
class SftEncoding:
  """How one record of a split becomes MaxText SFT tokens: template, tokenizer, prompt masking the way MaxText's
  `SFTPromptMasking` masks (target = pad id, which `ShiftData` turns into targets_segmentation 0), truncation."""

  encoder: Encoder
  columns: tuple[str, str]  # prompt, completion
  masking: input_pipeline_utils.SFTPromptMasking

  @classmethod
  def from_config(cls, config, encoder: Encoder, train: bool) -> "SftEncoding":
    masking = input_pipeline_utils.SFTPromptMasking(
        text_column_name="chunks",
        completion_only=config.sft_train_on_completion_only,
        max_target_length=config.max_target_length,
        unk_id=encoder.pad_id,
    )
    return cls(encoder, tuple(config.train_data_columns if train else config.eval_data_columns), masking)

  def tokens(self, record) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) of a record, before truncation."""
    return self.encoder.prompt_ids(record[self.columns[0]]), self.encoder.completion_ids(record[self.columns[1]])

  def example(self, prompt_ids, completion_ids) -> dict[str, np.ndarray]:
    """{inputs, targets}, truncated to max_target_length; a fresh dict (MaxText's transforms add keys in place)."""
    example = self.masking.map({"chunks": [prompt_ids, completion_ids], "is_prompt": [True, False]})
    return {"inputs": example["inputs"], "targets": example["targets"]}


# Each token's record index in its split: a per-token column, so that it survives packing. It travels with the
# batch for messages that name examples (a non-finite step's), and no loss reads it.
EXAMPLE_INDEX_KEY = "example_index"


def batch_example_indices(batch: dict) -> list[int]:
  """The split's record indices of this process's examples in a batch: per token (SFT rows, padding excluded) or
  [rows, 1] (preference pairs)."""
  if EXAMPLE_INDEX_KEY not in batch:
    return []
  indices = local_rows(batch[EXAMPLE_INDEX_KEY])
  if "inputs_segmentation" in batch:
    indices = indices[local_rows(batch["inputs_segmentation"]) != 0]
  return sorted({int(i) for i in indices.ravel()})


@dataclasses.dataclass(frozen=True)
class TokenizedExamples:
  """A split's kept examples as a grain source, each tokenized when read (so a process tokenizes the examples of
  its own batches only)."""

  source: sources.RecordSource
  kept: np.ndarray  # source indices
  encoding: SftEncoding

  def __len__(self):
    return len(self.kept)

  def __getitem__(self, index):
    source_index = int(self.kept[index])
    example = self.encoding.example(*self.encoding.tokens(self.source[source_index]))
    return example | {EXAMPLE_INDEX_KEY: np.full(len(example["inputs"]), source_index, np.int32)}


def _num_target_tokens(targets, prompt_len, pad_id) -> int:
  """Targets that carry loss after the next-token shift (position 0 is never predicted; masked prompt targets are
  the pad id); 0 when truncation left no completion token."""
  return int(np.count_nonzero(targets[1:] != pad_id)) if prompt_len < len(targets) else 0


def tokenize_split(source: sources.RecordSource, encoder: Encoder, config, split: str):
  """The split's setup pass (`split_pass`: each process tokenizes its block): returns (TokenizedExamples,
  SplitStats); overlong examples follow `config.overlong_policy`."""
  encoding = SftEncoding.from_config(config, encoder, split == "train")
  max_len = config.max_target_length

  def visit(index, record):
    prompt_ids, completion_ids = encoding.tokens(record)
    length = len(prompt_ids) + len(completion_ids)
    if length > max_len and config.overlong_policy == "error":
      raise ValueError(
          f"{split} example {index} of {source.description} has {length} tokens, more than "
          f"max_target_length={max_len} (overlong_policy=error)."
      )
    example = encoding.example(prompt_ids, completion_ids)
    inputs, targets = example["inputs"], example["targets"]
    targets_kept = _num_target_tokens(targets, len(prompt_ids), encoder.pad_id)
    if targets_kept == 0:
      return split_pass.Visit(kept=False, counts=(0, 1, 0, 0))
    digest = hashlib.sha256(np.asarray([len(inputs)], np.int64).tobytes() + inputs.tobytes() + targets.tobytes())
    return split_pass.Visit(True, (int(length > max_len), 0, len(inputs), targets_kept), digest.digest())

  table = split_pass.run(source, visit, num_counts=4)
  stats = SplitStats(
      source=source.description,
      num_examples=len(source),
      num_truncated=table.total(0),
      num_skipped=table.total(1),
      num_tokens=table.total(2),
      num_target_tokens=table.total(3),
      fingerprint=table.fingerprint,
  )
  if not table.kept.size:
    raise ValueError(f"Empty {split} split: all {len(source)} examples of {source.description} were skipped.")
  return TokenizedExamples(source, table.kept, encoding), stats


def prepare_split(config, train: bool, encoder: Encoder | None = None):
  """Opens and tokenizes the train (or eval) split: (TokenizedExamples, SplitStats)."""
  encoder = encoder or Encoder.from_config(config)
  return tokenize_split(sources.open_source(config, train), encoder, config, "train" if train else "eval")


def _batches(examples, config, batch, train: bool, shard_index: int, shard_count: int, batch_size: int):
  """The per-host grain pipeline, as MaxText builds it for dataset_type=grain (shuffle, repeat, shard, batch);
  `batch(dataset, batch_size)` turns examples into batches (MaxText's SFT formatting, or preference pairs)."""
  dataset = grain.MapDataset.source(examples)
  if train and config.enable_data_shuffling:
    dataset = dataset.shuffle(seed=config.data_shuffle_seed)
  if train:
    dataset = dataset.repeat()  # `steps` bounds training; each epoch is reshuffled
  dataset = dataset[shard_index::shard_count]
  dataset = dataset.to_iter_dataset(
      read_options=grain.ReadOptions(
          num_threads=config.grain_num_threads if train else config.grain_num_threads_eval,
          prefetch_buffer_size=config.grain_prefetch_buffer_size if train else config.grain_prefetch_buffer_size_eval,
      )
  )
  return data_processing_utils.apply_multiprocessing_and_prefetch(
      batch(dataset, batch_size),
      config,
      config.grain_worker_count if train else config.grain_worker_count_eval,
      config.grain_per_worker_buffer_size if train else config.grain_per_worker_buffer_size_eval,
  )


@dataclasses.dataclass(frozen=True)
class _TakeRows(grain.MapTransform):
  rows: slice

  def map(self, element):
    return {k: v[self.rows] for k, v in element.items()}


def _make_iterator(examples, batch, train, whole_batches, config, mesh, process_indices):
  """A MultiHostDataLoadIterator over this host's shard (the signature MaxText's create_process_specific_iterator
  calls). With `whole_batches` every host reads the global stream of examples, batches it globally and keeps its
  own block of rows, so a batch's layout does not depend on the number of processes."""
  batch_size = config.global_batch_size_to_load if train else config.global_batch_size_to_load_eval
  if batch_size % mesh.size:
    raise ValueError(f"Global batch size {batch_size} is not divisible by the {mesh.size} devices of the mesh.")
  if whole_batches:
    rows = process_rows(maxtext_sharding.get_input_data_sharding(config, mesh), (batch_size, config.max_target_length))
    whole = lambda dataset, size: batch(dataset, size).map(_TakeRows(rows))
    dataloader = _batches(examples, config, whole, train, 0, 1, batch_size)
  else:
    shard_index, shard_count = process_indices.index(jax.process_index()), len(process_indices)
    local_batch_size = data_processing_utils.get_local_batch_size(config) if train else batch_size // jax.process_count()
    dataloader = _batches(examples, config, batch, train, shard_index, shard_count, local_batch_size)
  return multihost_dataloading.MultiHostDataLoadIterator(
      dataloader,
      mesh,
      config.generate_padding_batch_train if train else config.generate_padding_batch_eval,
      expansion_loading_factor_for_grain=config.expansion_factor_real_data if train else -1,
  )


def host_iterator(examples, batch, config, mesh, train: bool, whole_batches: bool = False):
  """This process's iterator of global batches over `examples` (a grain source), or MaxText's placeholder when it
  loads no real data; `batch(dataset, batch_size)` forms the batches. By default each host reads its shard of the
  examples (MaxText's layout); `whole_batches` as in `_make_iterator` (cheap example streams: prompt indices)."""
  batch_size = config.global_batch_size_to_load if train else config.global_batch_size_to_load_eval
  batch_size_on = config.global_batch_size_to_train_on if train else config.global_batch_size_to_eval_on
  process_indices = input_pipeline_interface.get_process_loading_real_data(
      config.data_sharding, batch_size, batch_size_on, config.max_target_length, mesh
  )
  make = functools.partial(_make_iterator, examples, batch, train, whole_batches)
  return input_pipeline_interface.create_process_specific_iterator(config, mesh, process_indices, make, train)


def global_batch(rows: dict[str, np.ndarray], config, mesh) -> dict[str, jax.Array]:
  """Host arrays that every process holds whole as global arrays on the input data sharding, each process placing the
  slices its devices hold (`roles.FrozenModel.run_over_rows` where the batch axis does not split across processes
  in blocks)."""
  sharding = maxtext_sharding.get_input_data_sharding(config, mesh)
  return {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx]) for k, v in rows.items()}


def batch_sharding(config, mesh, ndim: int) -> jax.sharding.NamedSharding:
  """The input data sharding of the batch axis for an array of `ndim` dimensions (other axes replicated)."""
  batch_spec = maxtext_sharding.get_input_data_sharding(config, mesh).spec[0]
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(batch_spec, *([None] * (ndim - 1))))


def _addressable_span(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> slice:
  """The span of rows of a batch of `shape` on `sharding` from the first to the last that this process's devices hold."""
  rows = [index[0] for index in sharding.addressable_devices_indices_map(tuple(shape)).values()]
  return slice(min(r.start or 0 for r in rows), max(shape[0] if r.stop is None else r.stop for r in rows))


def process_block(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> slice | None:
  """The rows of a batch of `shape` on `sharding` that this process's devices hold, when they are one contiguous block
  of 1/process_count of them, as MaxText's loaders lay batches out; None otherwise (e.g. the batch replicated over a
  tensor-parallel axis that spans processes)."""
  span = _addressable_span(sharding, shape)
  if shape[0] % jax.process_count() or span.stop - span.start != shape[0] // jax.process_count():
    return None
  return span


def process_rows(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> slice:
  """`process_block` where process-local rows are needed: a mesh whose batch axis does not split across processes
  that way cannot take them (ValueError)."""
  block = process_block(sharding, shape)
  if block is None:
    span = _addressable_span(sharding, shape)
    raise ValueError(
        f"The batch sharding {sharding} gives process {jax.process_index()} rows {span.start}..{span.stop} of "
        f"{shape[0]}, not one block of 1/{jax.process_count()} of them; process-local rows need the batch axis "
        "split across processes (dcn_data_parallelism, or ICI axes laid over the processes)."
    )
  return block


def process_local_batch(rows: dict[str, np.ndarray], config, mesh) -> dict[str, jax.Array]:
  """This process's rows (rollouts it sampled and scored) as its block of global arrays on the input data sharding;
  every process passes the same number of rows."""
  out = {}
  for key, value in rows.items():
    sharding = batch_sharding(config, mesh, value.ndim)
    global_shape = (value.shape[0] * jax.process_count(), *value.shape[1:])
    process_rows(sharding, global_shape)  # fails clearly on a mesh that cannot take process-local rows
    out[key] = jax.make_array_from_process_local_data(sharding, value, global_shape)
  return out


def local_rows(array: jax.Array) -> np.ndarray:
  """This process's block of rows of a global array sharded on its first axis (see `process_rows`), on the host."""
  block = process_rows(array.sharding, array.shape)
  pieces = {}
  for shard in array.addressable_shards:
    if any(index != slice(None) and index != slice(0, size) for index, size in zip(shard.index[1:], array.shape[1:])):
      raise ValueError(f"Array of shape {array.shape} on {array.sharding} is split past its first axis.")
    pieces.setdefault(shard.index[0].start or 0, shard.data)
  local = np.concatenate([np.asarray(pieces[start]) for start in sorted(pieces)])
  assert len(local) == block.stop - block.start, (array.shape, array.sharding)
  return local


def check_supported(config):
  """Fails on data settings this pipeline would otherwise ignore."""
  if config.dataset_type != "grain":
    raise config_lib.ConfigError(
        f"The post-training pipelines read dataset_type=grain (grain_file_type tfds or jsonl), got dataset_type="
        f"{config.dataset_type}. MaxText's hf SFT pipeline builds chat templates with a Hugging Face tokenizer; "
        "export such data to JSONL with prompt/completion fields instead."
    )
  if config.grain_use_elastic_iterator:
    raise config_lib.ConfigError("grain_use_elastic_iterator is not supported by the maxtext_posttrain pipelines.")
  if config.colocated_python_data_input:
    raise config_lib.ConfigError("colocated_python_data_input is not supported by the maxtext_posttrain pipelines.")
  if 0 < config.expansion_factor_real_data < 1:
    raise config_lib.ConfigError("expansion_factor_real_data < 1 is not supported by the maxtext_posttrain pipelines.")


@dataclasses.dataclass(frozen=True)
class _KeepKeys(grain.MapTransform):
  keys: frozenset

  def map(self, element):
    return {k: v for k, v in element.items() if k in self.keys}


SFT_KEYS = ("inputs", "inputs_position", "inputs_segmentation", "targets", "targets_position", "targets_segmentation")


def make_sft_iterators(config, mesh, join=None, columns: tuple[str, ...] = ()):
  """(train_iterator, eval_iterator or None, DataStats). Eval is built when `config.eval_interval > 0`; it is not
  shuffled or repeated, and restarts from its first batch at every eval, so each eval sees the same batches.

  `join(examples, split, stats)` (split "train" or "eval") may return a source whose examples carry per-token
  `columns` beside inputs and targets ([length, ...] arrays: offline teacher logits); they are packed or padded
  with the tokens and are not shifted (position j's column belongs to input j)."""
  check_supported(config)
  encoder = Encoder.from_config(config)
  train_examples, train_stats = prepare_split(config, True, encoder)
  eval_examples, eval_stats = prepare_split(config, False, encoder) if config.eval_interval > 0 else (None, None)
  stats = DataStats(train=train_stats, eval=eval_stats)
  max_logging.log(f"SFT data: {stats.to_dict()}")
  if join is not None:
    train_examples = join(train_examples, "train", train_stats)
    eval_examples = join(eval_examples, "eval", eval_stats) if eval_examples else None
  # Packing adds `<column>_segment_ids` / `_positions` for every column; only the tokens' are kept.
  columns = (EXAMPLE_INDEX_KEY,) + columns
  keep = frozenset(SFT_KEYS + columns)

  def batch(dataset, batch_size):
    dataset = data_processing_utils.format_and_batch(
        dataset, config, batch_size, encoder.pad_id, ("inputs", "targets") + columns, encoder.tokenizer
    )
    return dataset.map(_KeepKeys(keep))

  train_iterator = host_iterator(train_examples, batch, config, mesh, train=True)
  eval_iterator = host_iterator(eval_examples, batch, config, mesh, train=False) if eval_examples else None
  return train_iterator, eval_iterator, stats

"""Merges a run's trained adapters into its base and writes a full MaxText checkpoint.

The result holds the same parameter tree as the model without adapters, in MaxText's on-disk layout
(`<output>/items/params/params/...`), so plain MaxText (pre-training, SFT, decoding) loads it with
`load_parameters_path=<output>/items` and no LoRA keys. Run it with the training config and keys:

  python -m maxtext_posttrain.peft.export sft_lora.yml run_name=... base_output_directory=... \
      [load_parameters_path=<the base the adapters were trained on>] --output=/path/to/merged
"""

from absl import flags

from flax import nnx
from flax.linen import partitioning as nn_partitioning

from maxtext.common import checkpointing
from maxtext.utils import max_logging
from maxtext.utils import maxtext_utils
from maxtext.utils import train_utils

from maxtext_posttrain import checkpoint_guard
from maxtext_posttrain import cli
from maxtext_posttrain import config as posttrain_config
from maxtext_posttrain import mesh as mesh_lib
from maxtext_posttrain import roles
from maxtext_posttrain import trained_model
from maxtext_posttrain.peft import adapter_checkpoint
from maxtext_posttrain.peft import lora


def adapter_model(config) -> tuple[nnx.Module, int]:
  """The policy with the adapters of the run directory's latest checkpoint, as the loop restores it; and the step.

  Raises ValueError when the run has no checkpoint, or when its adapters were trained on a base of another shape
  than this config builds (checkpoint_guard compares the stored adapter shapes with this model's).
  """
  if not config.lora.enable_lora:
    raise ValueError("Export merges LoRA adapters: set lora.enable_lora=true and the lora.* keys of the run.")
  lora.validate_config(config)
  mesh = mesh_lib.make_mesh(config)
  init_state_fn, _ = trained_model.state_initializer(config, mesh, roles.policy())
  with nn_partitioning.axis_rules(config.logical_axis_rules):
    abstract_state = nnx.eval_shape(init_state_fn)
  adapter_checkpoint.install()  # MaxText's restore then reads the adapter state the run saved
  checkpoint_manager = train_utils.create_checkpoint_manager(config, mesh, init_state_fn)
  step = None if checkpoint_manager is None else checkpointing.latest_step(checkpoint_manager)
  if step is None:
    raise ValueError(f"No adapter checkpoint under {config.checkpoint_dir}: nothing to export.")
  checkpoint_guard.check_compatible(checkpoint_manager, abstract_state, adapters_only=True)
  state, _, _, _, _ = maxtext_utils.setup_training_state(None, config, mesh, checkpoint_manager, init_state_fn)
  if config.load_parameters_path:  # the base the adapters were trained on; the restore above does not read it
    state = lora.reload_base(state, config, mesh)
  return nnx.merge(nnx.graphdef(abstract_state), state).model, step


def export(config, output: str) -> str:
  """Writes the merged weights to `output`; returns the path to pass as `load_parameters_path`."""
  model, step = adapter_model(config)
  params = lora.merged_params(model, config)  # sharded arrays: orbax writes each host's shards
  checkpointing.save_params_to_path(
      output, {"params": params}, config.checkpoint_storage_use_ocdbt, config.checkpoint_storage_use_zarr3
  )
  max_logging.log(f"Exported step {step}'s adapters merged into the base: load_parameters_path={output}/items")
  return f"{output}/items"


_OUTPUT = flags.DEFINE_string("output", None, "Directory of the merged MaxText checkpoint.", required=True)


def main(argv: list[str]) -> None:
  export(posttrain_config.initialize(list(argv)), _OUTPUT.value)


if __name__ == "__main__":
  cli.run(main)

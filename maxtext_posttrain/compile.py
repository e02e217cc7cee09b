"""Whether a post-training run fits a TPU slice, answered on a CPU host:

  python -m maxtext_posttrain.compile <config.yml> compile_topology=v5p-256 compile_topology_num_slices=1 \
    [model_name=llama3.1-8b] [key=value ...] [--compare_pretraining]

MaxText's `train_compile` answers it for pretraining: libtpu compiles the train step ahead of time for a topology the
host lacks, from shapes alone, and XLA's own out-of-memory check fails a program that cannot fit. A post-training run
runs more than one program, so this command compiles every program a run of the config's `posttrain_mode` executes,
the same way (MaxText's `get_topology_mesh`; states from MaxText's `get_abstract_state`; the loop's own jitted
programs lowered from `jax.ShapeDtypeStruct`s; `compiled.memory_analysis()`):

- the train step of every trained role (`trained_model.abstract`), and the primary role's eval step where the
  objective has held-out batches, on the batch shapes the objective declares (`Objective.batch_spec`); a frozen
  role read inside the step (a teacher) is part of these programs;
- the frozen roles' forwards that the objective's host hooks run: the reference's log-probs (DPO, GRPO and PPO with
  a KL term; on the decode program's arrays under `rl.reference_devices=sampler`), a reward model's scores, PPO's
  critic values, the old policy's log-probs under `rl.use_rollout_logps=false`;
- the rollout sampler's program (the prefill and the KV-cache decode loop are one program) for the largest prompt
  bucket, and the decode programs of the periodic evaluation.

Per program it prints the per-chip bytes XLA reports (arguments, outputs, the outputs aliased to donated arguments,
temporaries, generated code) and the bytes resident on a chip while it runs: what the run keeps between programs
(every trained role's weights and optimizer state, every frozen role's weights), the program's other inputs (the
batch), its outputs, temporaries (the sampler's KV cache among them) and code. XLA checks each program alone; the
resident figure is what must fit beside the rest of the run. A program XLA finds too large fails the command with
XLA's RESOURCE_EXHAUSTED message on one line, and so does one that fits alone but not beside what the run keeps. The
last lines are one JSON summary per program.

`--compare_pretraining` also compiles MaxText's pretraining train step (`train_compile`'s) for the same config and
topology and prints its row beside ours. It is an absl flag, not a config key: MaxText's config refuses keys it does
not know, and the comparison is a question put to this command, not a setting of a run.

libtpu lets one process per host load it; a second compile while one runs (or a test run alongside) needs
`ALLOW_MULTIPLE_LIBTPU_LOAD=1` in the environment.
"""

import dataclasses
import json
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from absl import flags
from flax import nnx
from flax.linen import partitioning as nn_partitioning

from maxtext.trainers.pre_train import train as pretrain
from maxtext.trainers.pre_train import train_compile
from maxtext.utils import max_logging
from maxtext.utils import max_utils
from maxtext.utils import maxtext_utils
from maxtext.utils import sharding

from maxtext_posttrain import cli
from maxtext_posttrain import config as posttrain_config
from maxtext_posttrain import forward
from maxtext_posttrain import objectives
from maxtext_posttrain import roles as roles_lib
from maxtext_posttrain import rollout
from maxtext_posttrain import trained_model
from maxtext_posttrain import trainer
from maxtext_posttrain.objectives import distill_on_policy
from maxtext_posttrain.objectives import dpo
from maxtext_posttrain.objectives import grpo
from maxtext_posttrain.objectives import ppo
from maxtext_posttrain.objectives import rl_base
from maxtext_posttrain.objectives import sft
from maxtext_posttrain.objectives.base import rows_spec
from maxtext_posttrain.peft import lora
from maxtext_posttrain.rollout import tools as tools_lib

_COMPARE_PRETRAINING = flags.DEFINE_bool(
    "compare_pretraining",
    False,
    "Also compile MaxText's pretraining train step (train_compile's) for the same model, batch and topology.",
)

GIB = 2**30
# Per-chip HBM that XLA's compile-time check allows, by `device_kind`: JAX's topology devices do not expose it
# (`memory_stats` needs an addressable device). The figures are those libtpu 0.0.50.1 states in its
# CompileTimeHbmOom message ("exceeds available HBM (95.73G)"), measured by compiling an oversize program for
# v4-8, v5e-8, v5p-8, v6e-8 and tpu7x-8 (the Cloud TPU documentation lists 32, 16, 95 and 32 GB for the first four).
HBM_GIB = {"TPU v4": 30.75, "TPU v5 lite": 15.75, "TPU v5": 95.73, "TPU v6 lite": 31.24, "TPU7x": 94.74}
SUMMARY_PREFIX = "compile_summary"
PRETRAINING = "MaxText pretraining train step"


@dataclasses.dataclass(frozen=True)
class Program:
  """One program of a run, compiled on demand.

  Attributes:
    name: what the run calls it ("policy train step", "reference forward", ...).
    compile: lowers and compiles it for the topology.
    live: per-chip bytes of the buffers the run keeps while it runs, by name (weights and optimizer states).
    inputs: per-chip bytes of its arguments that are not among those (the batch; the merged weights LoRA samples
      with).
  """

  name: str
  compile: Callable[[], jax.stages.Compiled]
  live: dict[str, int]
  inputs: int


@dataclasses.dataclass(frozen=True)
class Memory:
  """Per-chip bytes of one compiled program (`compiled.memory_analysis()`), and what is resident while it runs; or
  the out-of-memory error XLA raised compiling it (`error`, the byte counts then 0)."""

  program: str
  kept: int  # `Program.live`, summed
  inputs: int  # `Program.inputs`
  arguments: int = 0
  outputs: int = 0
  aliased: int = 0
  temporaries: int = 0
  code: int = 0
  error: str | None = None

  @property
  def resident(self) -> int:
    """Bytes on a chip while the program runs: what the run keeps, the program's other inputs, its outputs that do
    not overwrite a donated input, its temporaries and code. (XLA's `arguments` may leave out inputs the program
    does not read, such as the optimizer state in an eval step; the run keeps them all the same.)"""
    return self.kept + self.inputs + self.outputs - self.aliased + self.temporaries + self.code


def per_chip_bytes(tree) -> int:
  """Bytes of one device's shard of every sharded array (or `jax.ShapeDtypeStruct`) in `tree`."""
  return sum(
      math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
      for x in jax.tree.leaves(tree)
      if getattr(x, "sharding", None) is not None
  )


def hbm_bytes(mesh: jax.sharding.Mesh) -> int | None:
  """The per-chip HBM XLA allows on the topology's chips (`HBM_GIB`), None for a chip kind not in the table."""
  gib = HBM_GIB.get(mesh.devices.flat[0].device_kind)
  return None if gib is None else int(gib * GIB)


def _on(spec: dict[str, jax.ShapeDtypeStruct], data_sharding) -> dict[str, jax.ShapeDtypeStruct]:
  """`spec` placed as the loop places batches: on the input data sharding, as MaxText's data iterator does."""
  return {key: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=data_sharding) for key, s in spec.items()}


@dataclasses.dataclass
class Run:
  """A run's roles, abstract, on the topology mesh, and the buffers it keeps resident between programs."""

  config: object
  mesh: jax.sharding.Mesh
  objective: objectives.Objective
  trained: dict[str, trained_model.TrainedModel]
  frozen: dict[str, roles_lib.FrozenModel]
  kept: dict[str, int]  # per-chip bytes of what the run keeps between programs, by name
  options: dict

  def compile(self, lowered_in: Callable[[], jax.stages.Lowered]) -> Callable[[], jax.stages.Compiled]:
    """Compiles what `lowered_in()` lowers with the config's `compile_xla_flags`, as MaxText's train_compile does."""
    return lambda: lowered_in().compile(compiler_options=self.options)

  def step(self, name: str, role: trained_model.TrainedModel, batch, evaluation: bool = False) -> Program:
    """A trained role's train (or eval) step on `batch` (placed on the input sharding), over the role's state and
    the in-step frozen roles' weights."""
    in_step = {n: r.state for n, r in self.frozen.items() if r.spec.in_step}
    step = role.p_eval_step if evaluation else role.p_train_step

    def lowered():
      with role.scope(evaluation):
        return step.lower(role.state, batch, in_step)

    return Program(name, self.compile(lowered), self.kept, per_chip_bytes(batch))

  def forward(self, name: str, role, fn: Callable, *args) -> Program:
    """`role.run(fn, *args)`'s program (`FrozenModel` or `TrainedModel`) over the role's resident weights."""

    def lowered():
      with role.scope():
        return role.jitted(fn).lower(role.state, *args)

    return Program(name, self.compile(lowered), self.kept, per_chip_bytes(args))


def build(config) -> Run:
  """The run's roles on the topology mesh, abstract: what `trainer.setup` builds, initialised and read from nothing."""
  if not config.compile_topology:
    raise cli.Failure("Set compile_topology (e.g. compile_topology=v5p-256) to the TPU slice to compile for.")
  objective_class = objectives.get(config.posttrain_mode)
  trainer.check_supported(config)
  lora.validate_config(config)
  objective = objective_class(config)
  mesh = train_compile.get_topology_mesh(config)
  specs = objective.roles
  frozen = {spec.name: roles_lib.abstract_frozen(spec, config, mesh) for spec in specs if not spec.trained}
  data_sharding = sharding.get_input_data_sharding(config, mesh)
  has_eval = objective.batch_spec(train=False) is not None
  eval_sharding = sharding.get_input_data_sharding(config, mesh, rules=config.logical_axis_rules_for_eval)
  trained = {}
  for index, spec in enumerate(s for s in specs if s.trained):
    role_config = roles_lib.role_config(config, spec, primary=index == 0)
    evaluation = eval_sharding if index == 0 and has_eval else None
    trained[spec.name] = trained_model.abstract(spec, role_config, mesh, frozen, data_sharding, evaluation)
  kept = {}
  for name, model in trained.items():
    kept[f"{name} weights"] = per_chip_bytes(model.state.model)
    kept[f"{name} optimizer"] = per_chip_bytes(model.state.optimizer)
  for name, role in frozen.items():
    if role.follows_policy:  # the LoRA reference: the policy's own arrays, no weights of its own
      role.graphdef, role.state = nnx.split(trained[roles_lib.POLICY].model())
    else:
      kept[f"{name} weights"] = per_chip_bytes(role.state)
  options = max_utils.parse_libtpu_flags_to_dict(config.compile_xla_flags)
  return Run(config, mesh, objective, trained, frozen, kept, options)


def _decode(
    run: Run, name: str, sampler: rollout.Sampler, prompts: int, num_samples: int, max_new_tokens: int, sampling
) -> Program:
  """`sampler`'s program for `prompts` prompts of the largest bucket (max_prefill_predict_length tokens) of its
  config; it reads the policy's weights in place, or under LoRA a merged copy (`lora.policy_params`) held beside the
  train state."""
  config = sampler.config

  def lowered():
    return sampler.lower(prompts, config.max_prefill_predict_length, num_samples, max_new_tokens, sampling)

  # The prompts' token arrays (a few KiB) are left out of the inputs.
  inputs = per_chip_bytes(sampler.abstract_params) if lora.enabled(config) else 0
  return Program(name, run.compile(lowered), run.kept, inputs)


def _rollout_request(objective: rl_base.RLObjective, config) -> tuple | None:
  """(prompts, samples per prompt, max new tokens, sampling) of an RL objective's rollouts; None when it never
  samples (on-policy distillation that trains on the reference answers only)."""
  if isinstance(objective, distill_on_policy.DistillOnPolicy) and not objective.section.on_policy_fraction:
    return None
  return (config.global_batch_size_to_load, objective.rl.num_generations, objective.max_new_tokens, objective.sampling)


def _rollout_programs(run: Run) -> list[Program]:
  """What an RL objective's `before_step` runs: the rollout sampler, then the forwards that score the rollouts."""
  objective, config = run.objective, run.config
  request = _rollout_request(objective, config)
  if request is None:
    return []
  sampler = rollout.Sampler(config, run.mesh)
  programs = [_decode(run, "rollout sampler", sampler, *request)]
  if objective.rl.tools:  # later turns: every row again, a prompt and a completion long (`tools.PendingToolRollouts`)
    prompts, num_samples, max_new_tokens, sampling = request
    later = rollout.Sampler(tools_lib.followup_config(config), run.mesh)
    name = "rollout sampler, later tool turns"
    programs.append(_decode(run, name, later, prompts * num_samples, 1, max_new_tokens, sampling))
  data_sharding = sharding.get_input_data_sharding(config, run.mesh)
  rows, length = request[0] * request[1], config.max_target_length
  if rl_base.REWARD_MODEL in run.frozen:
    scored = _on(rows_spec(rows, length, ("inputs", "positions", "segmentation")), data_sharding)
    reward_model = run.frozen[rl_base.REWARD_MODEL]
    programs.append(run.forward("reward model scores", reward_model, forward.last_token_scalars, scored))
  if not isinstance(objective, (grpo.GRPO, ppo.PPO)):
    return programs
  # The rollouts' rows (`rl_base.training_rows`), with GRPO's advantages; PPO's come after the critic's values.
  keys = rl_base.ROW_KEYS if isinstance(objective, grpo.GRPO) else rl_base.ROW_KEYS[:6]
  batch = _on(rows_spec(rows, length, keys, floats=rl_base.ROW_FLOATS), data_sharding)
  replicated = jax.sharding.NamedSharding(run.mesh, jax.sharding.PartitionSpec())
  temperature = jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated)
  if not objective.rl.use_rollout_logps:  # GRPO reads the policy through a frozen view of its model, PPO directly
    policy = run.trained[roles_lib.POLICY]
    if isinstance(objective, grpo.GRPO):
      policy = roles_lib.FrozenModel(roles_lib.reference(), config, run.mesh, *nnx.split(policy.model()))
    programs.append(run.forward("old policy forward", policy, objective.target_logps, batch, temperature))
  if roles_lib.REFERENCE in run.frozen and objective.rl.reference_devices == "sampler":
    # The decode program's arrays (`rollout.PendingRollouts`), scored as they come out of it.
    prompts, num_samples, max_new_tokens, _ = request
    decoded = sampler.abstract_arrays(prompts, config.max_prefill_predict_length, num_samples, max_new_tokens)
    reference = run.frozen[roles_lib.REFERENCE]
    name = "reference forward, on the decoded rollouts"
    programs.append(run.forward(name, reference, objective.rollout_logps, *decoded, temperature))
  elif roles_lib.REFERENCE in run.frozen:
    reference = run.frozen[roles_lib.REFERENCE]
    programs.append(run.forward("reference forward", reference, objective.target_logps, batch, temperature))
  if isinstance(objective, ppo.PPO):
    critic = run.trained[ppo.CRITIC]
    programs.append(run.forward("critic values", critic, objective._values, batch))  # pylint: disable=protected-access
  return programs


def _preference_reference(run: Run, batch: dict[str, jax.ShapeDtypeStruct], name: str) -> Program:
  """DPO's reference log-probs of a batch of pairs (`dpo.reference_logps`), before the step adds them."""
  pairs = {key: batch[key] for key in dpo.Preference.batch_keys}
  return run.forward(name, run.frozen[roles_lib.REFERENCE], dpo.reference_logps, pairs)


def _precomputed_reference(run: Run, batch: dict[str, jax.ShapeDtypeStruct]) -> Program:
  """DPO's one scoring pass at setup (`dpo.precompute_reference_logprobs`): a copy of the starting policy, alone
  on the chips (the trained roles are built after it and it is freed)."""
  reference = roles_lib.abstract_frozen(roles_lib.reference(), run.config, run.mesh, copy=True)
  pairs = {key: batch[key] for key in dpo.Preference.batch_keys}

  def lowered():
    with reference.scope():
      return reference.jitted(dpo.reference_logps).lower(reference.state, pairs)

  live = {"reference weights (setup)": per_chip_bytes(reference.state)}
  return Program("reference forward (setup)", run.compile(lowered), live, per_chip_bytes(pairs))


def programs(run: Run) -> list[Program]:
  """Every program a run executes, in the order of a step: the host hooks' programs, the trained roles' steps,
  then the periodic evaluation's."""
  objective, config = run.objective, run.config
  data_sharding = sharding.get_input_data_sharding(config, run.mesh)
  train_batch = _on(objective.batch_spec(train=True), data_sharding)
  preference_reference = isinstance(objective, dpo.Preference) and roles_lib.REFERENCE in run.frozen
  out = []
  if isinstance(objective, dpo.Preference) and objective.precompute:
    out.append(_precomputed_reference(run, train_batch))
  if isinstance(objective, rl_base.RLObjective):
    out += _rollout_programs(run)
  if preference_reference:
    out.append(_preference_reference(run, train_batch, "reference forward"))
  for name, model in run.trained.items():
    out.append(run.step(f"{name} train step", model, train_batch))
  primary = next(iter(run.trained.values()))
  if primary.p_eval_step is not None:
    eval_sharding = sharding.get_input_data_sharding(config, run.mesh, rules=config.logical_axis_rules_for_eval)
    eval_batch = _on(objective.batch_spec(train=False), eval_sharding)
    if preference_reference:
      out.append(_preference_reference(run, eval_batch, "reference forward (evaluation)"))
    out.append(run.step(f"{primary.name} eval step", primary, eval_batch, evaluation=True))
  if config.eval_interval <= 0 or config.eval_generation_examples <= 0:
    return out
  max_new_tokens = posttrain_config.max_new_tokens(config)
  if isinstance(objective, rl_base.RLObjective):  # `evaluate.sample_texts`: chunks of the training batch's prompts
    request = (config.global_batch_size_to_train_on, config.eval_samples_per_prompt, max_new_tokens)
    request += (rollout.SamplingParams.from_config(config),)
    if request != _rollout_request(objective, config):  # else the rollout sampler's program serves it
      out.append(_decode(run, "evaluation sampler", rollout.Sampler(config, run.mesh), *request))
  elif isinstance(objective, sft.SFT):  # `generation_eval`: every held-out prompt at once, greedily
    request = (config.eval_generation_examples, 1, max_new_tokens, rollout.SamplingParams())
    out.append(_decode(run, "evaluation greedy decode", rollout.Sampler(config, run.mesh), *request))
  return out


def pretraining(run: Run) -> Program:
  """MaxText's pretraining train step for the same config on the same topology, as `train_compile.main` builds it
  (`get_shaped_inputs`, `get_functional_train_with_signature(train.train_step, ...)`, `jit_and_compile`)."""
  config, mesh = run.config, run.mesh
  shaped_args, shaped_kwargs, state_mesh_shardings, _, graphdef = train_compile.get_shaped_inputs(mesh, config)
  params_shardings, state_mesh_shardings = sharding.maybe_update_params_sharding_with_opt(config, state_mesh_shardings)
  state_shardings = sharding.build_zero1_input_state_mesh_shardings(config, state_mesh_shardings, params_shardings)
  train_step, in_shardings, out_shardings, static_argnums, donate_argnums = (
      maxtext_utils.get_functional_train_with_signature(
          pretrain.train_step,
          sharding.get_input_data_sharding(config, mesh),
          state_shardings,
          graphdef,
          config,
          params_shardings,
      )
  )

  def compiled():
    return train_compile.jit_and_compile(
        train_step,
        shaped_args,
        shaped_kwargs,
        mesh,
        in_shardings,
        out_shardings,
        static_argnums,
        donate_argnums,
        config,
        nn_partitioning.axis_rules(config.logical_axis_rules),
    )

  state, batch = shaped_args
  return Program(PRETRAINING, compiled, {"train state": per_chip_bytes(state)}, per_chip_bytes(batch))


def measure(program: Program) -> Memory:
  """Compiles `program`; its per-chip memory, or XLA's out-of-memory error (any other error propagates)."""
  max_logging.log(f"Compiling the {program.name}.")
  kept = sum(program.live.values())
  try:
    analysis = program.compile().memory_analysis()
  except jax.errors.JaxRuntimeError as error:
    if "RESOURCE_EXHAUSTED" not in str(error):
      raise
    return Memory(program.name, kept, program.inputs, error=str(error).split("\n", 1)[0].strip())
  return Memory(
      program.name,
      kept,
      program.inputs,
      arguments=analysis.argument_size_in_bytes,
      outputs=analysis.output_size_in_bytes,
      aliased=analysis.alias_size_in_bytes,
      temporaries=analysis.temp_size_in_bytes,
      code=analysis.generated_code_size_in_bytes,
  )


def compile_run(config, compare_pretraining: bool = False) -> tuple[Run, list[Memory]]:
  """The run's roles on the topology and every program's memory (MaxText's pretraining step last when asked)."""
  run = build(config)
  run_programs = programs(run) + ([pretraining(run)] if compare_pretraining else [])
  return run, [measure(program) for program in run_programs]


def failure(memories: list[Memory], hbm: int | None, device_kind: str) -> str | None:
  """The first program that does not fit, in one line: XLA's error, or its resident bytes over the chip's HBM."""
  for memory in memories:
    if memory.error is not None:
      return f"The {memory.program} does not fit a {device_kind} chip: {memory.error}"
    if hbm is not None and memory.resident > hbm:
      return (
          f"The {memory.program} fits alone but not beside what the run keeps resident: {memory.resident / GIB:.2f} "
          f"GiB per chip ({memory.kept / GIB:.2f} GiB of it weights and optimizer states kept between programs) "
          f"exceeds the {hbm / GIB:.2f} GiB of HBM XLA allows on a {device_kind} chip."
      )
  return None


def report(run: Run, memories: list[Memory]) -> None:
  """Prints the run's resident buffers, a per-program table (GiB per chip) and one JSON summary line per program."""
  config, mesh = run.config, run.mesh
  hbm = hbm_bytes(mesh)
  device_kind = mesh.devices.flat[0].device_kind
  primary = next(iter(run.trained.values()))
  parameters = sum(x.size for x in jax.tree.leaves(primary.state.model.filter(nnx.Param)))
  hbm_text = f"{hbm / GIB:.2f} GiB HBM per chip (XLA's limit)" if hbm else "HBM per chip unknown (not in HBM_GIB)"
  print(
      f"posttrain_mode={config.posttrain_mode}: {primary.name} of {parameters / 1e9:.3f}B parameters on "
      f"{config.compile_topology} x {config.compile_topology_num_slices} slice(s) = {mesh.devices.size} x {device_kind}, "
      f"mesh {({axis: size for axis, size in mesh.shape.items() if size > 1})}; {hbm_text}"
  )
  print("Kept resident between programs, GiB per chip: " + ", ".join(f"{k} {v / GIB:.3f}" for k, v in run.kept.items()))
  header = ("program", "arguments", "outputs", "aliased", "temporaries", "code", "resident", "of HBM")
  print(f"{header[0]:<34}" + "".join(f"{h:>12}" for h in header[1:]))
  for m in memories:
    if m.error is not None:
      print(f"{m.program:<34}  out of memory: {m.error}")
      continue
    share = f"{100 * m.resident / hbm:.1f}%" if hbm else "?"
    sizes = (m.arguments, m.outputs, m.aliased, m.temporaries, m.code, m.resident)
    print(f"{m.program:<34}" + "".join(f"{b / GIB:>12.3f}" for b in sizes) + f"{share:>12}")
  for m in memories:
    sizes = {f: None if m.error else getattr(m, f) for f in ("arguments", "outputs", "aliased", "temporaries", "code")}
    row = {"program": m.program} | sizes | {"kept": m.kept, "inputs": m.inputs}
    row |= {"resident": None if m.error else m.resident, "hbm": hbm, "fits": failure([m], hbm, device_kind) is None}
    print(f"{SUMMARY_PREFIX} " + json.dumps(row | {"error": m.error}))


def main(argv: Sequence[str]) -> None:
  config = posttrain_config.initialize(list(argv))
  run, memories = compile_run(config, _COMPARE_PRETRAINING.value)
  report(run, memories)
  problem = failure(memories, hbm_bytes(run.mesh), run.mesh.devices.flat[0].device_kind)
  if problem is not None:
    raise cli.Failure(problem)


if __name__ == "__main__":
  cli.run(main)

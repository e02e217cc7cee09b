#!/usr/bin/env bash
# Reruns every command whose figures README.md quotes (demo tables, DPO/ORPO/SimPO accuracies, benchmark rows), one
# after another so that timings do not share the CPU, and keeps each command's output in <output dir>/<name>.log.
# Run it in a clean clone of the commit whose README it checks, after `make env`:
#
#   bash scripts/readme_figures.sh /tmp/figures            # everything (about 70 minutes on 2 CPU cores)
#   bash scripts/readme_figures.sh /tmp/figures demo dpo   # only the named groups: demo, dpo, rm, tools, distill, compile,
#                                                          # bench, peers (Tunix side by side: needs .venv-peers,
#                                                          # `make peers-env`)
#
# The suite's size and time come from `make test` (or `.ci/run`) on the same clone.
set -euo pipefail

OUT=$(realpath -m "${1:?usage: scripts/readme_figures.sh <output dir> [demo] [dpo] [rm] [tools] [distill] [compile] [bench] [peers]}")
shift
GROUPS_WANTED=${*:-demo dpo rm tools distill compile bench}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$(pwd)
PY=.venv/bin/python
export JAX_PLATFORMS=cpu
unset XLA_FLAGS
mkdir -p "$OUT"
echo "commit $(git rev-parse HEAD)$(git diff --quiet HEAD || echo ' (with uncommitted changes)'); $(nproc) cores"

run() {
  local name=$1
  shift
  echo ">> $name: $*"
  local start=$SECONDS
  "$@" >"$OUT/$name.log" 2>&1
  echo "   done in $((SECONDS - start)) s -> $OUT/$name.log"
}

wanted() { [[ " $GROUPS_WANTED " == *" $1 "* ]]; }

if wanted demo; then
  run demo_grpo "$PY" -m maxtext_posttrain.demo --output_dir="$OUT/demo"
  run demo_gspo_token "$PY" -m maxtext_posttrain.demo --mode=gspo_token --output_dir="$OUT/demo"
  run demo_ppo "$PY" -m maxtext_posttrain.demo --mode=ppo --output_dir="$OUT/demo"
fi

if wanted dpo; then
  run dpo_sft "$PY" -m maxtext_posttrain.train sft.yml run_name=sft base_output_directory="$OUT/dpo" steps=200
  run dpo "$PY" -m maxtext_posttrain.train dpo.yml run_name=dpo base_output_directory="$OUT/dpo" \
    load_parameters_path="$OUT/dpo/sft/checkpoints/199/items" eval_interval=50 eval_steps=8 \
    metrics_file="$OUT/dpo/dpo_metrics.jsonl"
  run dpo_random "$PY" -m maxtext_posttrain.train dpo.yml run_name=dpo_random base_output_directory="$OUT/dpo" \
    eval_interval=250 eval_steps=8 enable_checkpointing=false
  for algo in orpo simpo; do  # the reference-free algorithms from random weights, as the tests run them
    run "$algo" "$PY" -m maxtext_posttrain.train dpo.yml run_name="$algo" base_output_directory="$OUT/dpo" \
      dpo.algo="$algo" learning_rate=3e-3 steps=75 eval_interval=75 eval_steps=8 max_target_length=64 \
      dpo.max_prompt_length=48 enable_checkpointing=false
  done
fi

if wanted rm; then  # the reward model starts from a 4-layer SFT model
  run rm_sft4 "$PY" -m maxtext_posttrain.train sft.yml run_name=sft4 base_output_directory="$OUT/rm" steps=200 \
    base_num_decoder_layers=4
  run reward_model "$PY" -m maxtext_posttrain.train reward_model.yml run_name=rm base_output_directory="$OUT/rm" \
    load_parameters_path="$OUT/rm/sft4/checkpoints/199/items" base_num_decoder_layers=4 enable_checkpointing=false
fi

if wanted tools; then  # GSM8K's calculator on the bundled hard problems: SFT on its annotations, evaluation, RL
  TOOLS=(grain_train_files=arithmetic_word_problems/hard_calculator grain_eval_files=arithmetic_word_problems/hard_calculator
    max_target_length=192 max_prefill_predict_length=96)
  run tools_sft "$PY" -m maxtext_posttrain.train sft.yml run_name=sft base_output_directory="$OUT/tools" "${TOOLS[@]}" \
    steps=1500 checkpoint_period=500 eval_interval=0
  for tools in plain:[] calculator:[calculator]; do
    run "tools_eval_${tools%%:*}" "$PY" -m maxtext_posttrain.evaluate sft.yml run_name="eval_${tools%%:*}" \
      base_output_directory="$OUT/tools" "${TOOLS[@]}" load_parameters_path="$OUT/tools/sft/checkpoints/1499/items" \
      eval_generation_examples=128 "rl.tools=${tools#*:}"
  done
  for tools in calculator:[calculator] plain:[]; do  # GRPO from the same checkpoint with and without the calculator
    run "tools_grpo_${tools%%:*}" "$PY" -m maxtext_posttrain.train grpo.yml run_name="grpo_${tools%%:*}" \
      base_output_directory="$OUT/tools" "${TOOLS[@]}" load_parameters_path="$OUT/tools/sft/checkpoints/500/items" \
      steps=150 "rl.tools=${tools#*:}"
  done
fi

if wanted distill; then
  run demo_distill "$PY" -m maxtext_posttrain.demo --mode=distill --output_dir="$OUT/distill"
  run score_teacher "$PY" -m maxtext_posttrain.score_teacher distill.yml run_name=score \
    base_output_directory="$OUT/distill" offline_data_dir="$OUT/distill/logits" distill.top_k=16 \
    teacher_overrides.load_parameters_path="$OUT/distill/demo_teacher/checkpoints/299/items"
fi

if wanted compile; then  # ahead-of-time compiles for TPU topologies (libtpu, no TPU); the 70B must not fit
  POD=(compile_topology_num_slices=1 dtype=bfloat16 attention=autoselected per_device_batch_size=1 max_target_length=2048
    run_name=compile base_output_directory="$OUT/compile")
  # qwen3's model config names a Hugging Face tokenizer; the bundled one stands in (nothing is tokenized here).
  QWEN=(compile_topology=v5p-8 model_name=qwen3-0.6b override_model_config=true tokenizer_type=sentencepiece "${POD[@]}")
  # Per model: SFT with MaxText's pretraining step beside it, DPO, GRPO, and MaxText's pretraining step on as many
  # rows per chip as DPO's (2: chosen and rejected) and GRPO's (8 completions) train steps hold.
  compile_model() {
    local name=$1
    shift
    run "compile_${name}_sft" "$PY" -m maxtext_posttrain.compile sft.yml "$@" --compare_pretraining
    run "compile_${name}_dpo" "$PY" -m maxtext_posttrain.compile dpo.yml "$@"
    run "compile_${name}_grpo" "$PY" -m maxtext_posttrain.compile grpo.yml "$@" max_prefill_predict_length=1024 \
      rl.grpo_beta=0.04
    for rows in 2 8; do
      run "compile_${name}_sft_rows$rows" "$PY" -m maxtext_posttrain.compile sft.yml "$@" per_device_batch_size=$rows \
        --compare_pretraining
    done
  }
  compile_model qwen "${QWEN[@]}"
  run compile_qwen_lora "$PY" -m maxtext_posttrain.compile sft_lora.yml "${QWEN[@]}"
  # The other objectives on qwen3-0.6b: PPO (policy and critic steps, 8 completions as GRPO), a reward model (2
  # rows per pair, as DPO) and logit distillation from qwen3-1.7b (the teacher's keys are teacher_overrides'; compiling
  # reads no weights, so its checkpoint path need not exist).
  run compile_qwen_ppo "$PY" -m maxtext_posttrain.compile ppo.yml "${QWEN[@]}" max_prefill_predict_length=1024 \
    rl.grpo_beta=0.04
  run compile_qwen_reward_model "$PY" -m maxtext_posttrain.compile reward_model.yml "${QWEN[@]}"
  run compile_qwen_distill "$PY" -m maxtext_posttrain.compile distill.yml "${QWEN[@]}" \
    teacher_overrides.model_name=qwen3-1.7b teacher_overrides.override_model_config=true \
    teacher_overrides.tokenizer_type=sentencepiece teacher_overrides.base_num_decoder_layers=28 \
    teacher_overrides.load_parameters_path="$OUT/compile/no_teacher_checkpoint" eval_interval=-1
  compile_model llama8b compile_topology=v5p-256 model_name=llama3.1-8b "${POD[@]}"
  # A mixture-of-experts model (30.5B parameters, 128 experts, 8 per token) with the router's load-balance loss at
  # qwen3-235b-a22b's weight: SFT beside MaxText's pretraining step (the same term in both), and GRPO.
  MOE=(compile_topology=v5p-64 model_name=qwen3-30b-a3b override_model_config=true tokenizer_type=sentencepiece
    load_balance_loss_weight=0.001 "${POD[@]}")
  run compile_qwen3moe_sft "$PY" -m maxtext_posttrain.compile sft.yml "${MOE[@]}" --compare_pretraining
  run compile_qwen3moe_grpo "$PY" -m maxtext_posttrain.compile grpo.yml "${MOE[@]}" max_prefill_predict_length=1024 \
    rl.grpo_beta=0.04
  run compile_llama70b_sft "$PY" -m maxtext_posttrain.compile sft.yml compile_topology=v5p-8 model_name=llama2-70b \
    "${POD[@]}" || true  # fails with XLA's out-of-memory message, as it should
fi

if wanted bench; then
  cd "$OUT"  # the benchmarks write their JSON rows into the working directory
  export PYTHONPATH=$REPO
  PY=$REPO/.venv/bin/python
  run bench_sft "$PY" -m benchmarks.sft_vs_pretrain --repeats=10
  run bench_sft_vocab32000 "$PY" -m benchmarks.sft_vs_pretrain --repeats=10 vocab_size=32000
  XLA_FLAGS=--xla_force_host_platform_device_count=4 run bench_sft_4devices "$PY" -m benchmarks.sft_vs_pretrain \
    --repeats=10 per_device_batch_size=2 ici_fsdp_parallelism=2 ici_tensor_parallelism=2
  run bench_dpo "$PY" -m benchmarks.dpo_vs_pretrain --repeats=5
  run bench_grpo "$PY" -m benchmarks.grpo_vs_pretrain --repeats=5
  XLA_FLAGS=--xla_force_host_platform_device_count=4 run bench_rollouts_ahead "$PY" -m benchmarks.rollouts_ahead
  run bench_ppo "$PY" -m benchmarks.ppo_vs_pretrain --repeats=5
  run bench_distill "$PY" -m benchmarks.distill_vs_pretrain --repeats=5
  run bench_decode "$PY" -m benchmarks.decode --repeats=3 --baseline_steps=16
  run bench_peft "$PY" -m benchmarks.peft_memory --repeats=3 --models=llama2-7b,llama3.1-8b,qwen3-8b,gemma2-9b,qwen3-0.6b
fi

if wanted peers; then
  cd "$OUT"
  export PYTHONPATH=$REPO
  PEERS=$REPO/.venv-peers/bin/python
  PY=$REPO/.venv/bin/python
  AHEAD=(rl.off_policy_steps=1 trainer_devices_fraction=1 sampler_devices_fraction=1)
  run peers_tiny "$PEERS" -m benchmarks.peers --repeats=5 --output=peers_tiny.json
  run peers_tiny_ahead "$PEERS" -m benchmarks.peers --repeats=5 --output=peers_tiny_ahead.json "${AHEAD[@]}"
  run peers_benchmark "$PEERS" -m benchmarks.peers --model=benchmark --repeats=7 --output=peers_benchmark.json
  # Rollouts overlapping training on a device of their own: ours one step ahead; Tunix synchronous on one device,
  # then with its rollout on a mesh of its own (its asynchronous layout).
  XLA_FLAGS=--xla_force_host_platform_device_count=2 run peers_tiny_split "$PEERS" -m benchmarks.peers --repeats=7 \
    --output=peers_tiny_split.json rl.off_policy_steps=1 --tunix_devices=1
  XLA_FLAGS=--xla_force_host_platform_device_count=2 run peers_tiny_split_tunix_async "$PEERS" -m benchmarks.peers \
    --repeats=7 --output=peers_tiny_split_tunix_async.json rl.off_policy_steps=1 --tunix_devices=1 \
    --tunix_rollout_devices=1
  # Ours with its reference on the sampler's device too (rl.reference_devices=sampler), Tunix synchronous on one.
  XLA_FLAGS=--xla_force_host_platform_device_count=2 run peers_tiny_split_reference "$PEERS" -m benchmarks.peers \
    --repeats=7 --output=peers_tiny_split_reference.json rl.off_policy_steps=1 rl.reference_devices=sampler \
    --tunix_devices=1
  # The peers' tiny GRPO step with one device for the trainer and one for the sampler, ours alone.
  XLA_FLAGS=--xla_force_host_platform_device_count=2 run rollouts_ahead_tiny "$PY" -m benchmarks.rollouts_ahead \
    --repeats=3 --output=rollouts_ahead_tiny.json base_emb_dim=256 base_num_query_heads=4 base_num_kv_heads=4 \
    head_dim=64 base_mlp_dim=512 base_num_decoder_layers=2 vocab_size=1024 max_target_length=128 \
    max_prefill_predict_length=64 scan_layers=false remat_policy=none per_device_batch_size=1 rl.num_generations=2
fi

#!/usr/bin/env bash
# Runs one command as an N-process JAX job on this machine: the local stand-in for an xpk CPU workload.
#
#   scripts/launch_local.sh N <command...>
#   scripts/launch_local.sh 2 python -m maxtext_posttrain.train maxtext_posttrain/configs/sft.yml run_name=r \
#     base_output_directory=/tmp/out steps=3 skip_jax_distributed_system=false dcn_data_parallelism=2
#
# Each process gets the environment MaxText's CPU start-up reads (max_utils.initialize_jax_for_cpu):
# JAX_COORDINATOR_ADDRESS, JOB_INDEX, JOB_COMPLETION_INDEX, PROCESSES_IN_JOB and JAX_PROCESS_COUNT, plus
# MaxText's environment overrides M_HARDWARE=cpu and M_NUM_SLICES=N (each process stands for one slice, so
# MaxText's dcn_* axes span processes; see maxtext_posttrain/mesh.py), and LOCAL_DEVICES fake CPU devices (default 2). MaxText's coordinator listens on port 1234, so one job at a time.
# Process 0 writes to this terminal; process i > 0 to $LAUNCH_LOG_DIR/process_<i>.log (default: a temp dir), and
# each process's pid goes to $LAUNCH_LOG_DIR/process_<i>.pid.
# The first process to fail stops the others (TERM, then KILL) and its exit status is the launcher's; a process
# killed by a signal counts as failed, so a lost host never leaves the others waiting in a collective.
set -uo pipefail

if [[ $# -lt 2 || ! $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 N <command...>   (N processes, N >= 1)" >&2
  exit 2
fi
num_processes=$1
shift

local_devices=${LOCAL_DEVICES:-2}
log_dir=${LAUNCH_LOG_DIR:-$(mktemp -d -t launch_local.XXXXXX)}
mkdir -p "$log_dir"

# MaxText's environment overrides (M_<KEY>), each unless the command line sets the key itself (MaxText refuses both).
maxtext_env=(M_HARDWARE=cpu M_NUM_SLICES="$num_processes")
for arg in "$@"; do
  [[ $arg == hardware=* ]] && maxtext_env=("${maxtext_env[@]/M_HARDWARE=*/}")
  [[ $arg == num_slices=* ]] && maxtext_env=("${maxtext_env[@]/M_NUM_SLICES=*/}")
done

pids=()
for ((i = 0; i < num_processes; i++)); do
  env_i=(
    JAX_COORDINATOR_ADDRESS="${JAX_COORDINATOR_ADDRESS:-localhost}"
    JOB_INDEX=0 JOB_COMPLETION_INDEX="$i" PROCESSES_IN_JOB="$num_processes" JAX_PROCESS_COUNT="$num_processes"
    JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=$local_devices ${XLA_FLAGS:-}"
    ${maxtext_env[@]}
  )
  if ((i == 0)); then
    env "${env_i[@]}" "$@" &
  else
    env "${env_i[@]}" "$@" >"$log_dir/process_$i.log" 2>&1 &
  fi
  pids+=($!)
  echo "$!" >"$log_dir/process_$i.pid"
done

stop_all() {
  kill -TERM "${pids[@]}" 2>/dev/null
  for _ in $(seq 20); do
    alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    ((alive)) || return
    sleep 0.5
  done
  kill -KILL "${pids[@]}" 2>/dev/null
}
trap 'stop_all; exit 130' INT TERM

status=0
running=("${pids[@]}")
while ((${#running[@]})); do
  wait -n -p finished "${running[@]}"
  rc=$?
  remaining=()
  for pid in "${running[@]}"; do [[ $pid != "$finished" ]] && remaining+=("$pid"); done
  running=("${remaining[@]}")
  if ((rc != 0)); then
    for ((i = 0; i < num_processes; i++)); do [[ ${pids[i]} == "$finished" ]] && failed=$i; done
    echo "launch_local: process $failed (pid $finished) exited with status $rc; stopping the other processes" >&2
    if ((failed > 0)); then
      echo "launch_local: last lines of $log_dir/process_$failed.log:" >&2
      tail -n 20 "$log_dir/process_$failed.log" >&2
    fi
    status=$rc
    stop_all
    break
  fi
done
wait 2>/dev/null
exit $status

#!/usr/bin/env bash
# Launch a ScaleTorch script with torchrun, on one node or several.
#
#   scripts/launch.sh SCRIPT [--nproc-per-node N] [--nnodes N --node-rank R
#                    --master-addr A --master-port P] [--max-restarts N] [-- SCRIPT ARGS]
#
# Examples:
#   scripts/launch.sh examples/00_single_device.py
#   scripts/launch.sh examples/01_ddp.py --nproc-per-node 2 -- --check --steps 10
#   # two nodes, run once on each (node ranks 0 and 1):
#   scripts/launch.sh examples/01_ddp.py --nproc-per-node 4 --nnodes 2 --node-rank 0 \
#       --master-addr 10.0.0.1 --master-port 29500
#
# On a machine without a GPU it sets OMP_NUM_THREADS=1 (unless already set), so that ranks
# sharing the CPU do not fight over its cores. It sets TORCH_NCCL_ASYNC_ERROR_HANDLING=1
# (unless already set), so that on GPUs NCCL's watchdog ends a run whose collective failed or
# outlived the timeout, without blocking waits (doc/fault_tolerance.md). It prints the command.
set -euo pipefail

usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; }

if [[ $# -eq 0 || "$1" == "-h" || "$1" == "--help" ]]; then
  usage
  exit 0
fi
script="$1"
shift
if [[ ! -f "$script" ]]; then
  echo "launch.sh: script '$script' not found" >&2
  exit 2
fi

nproc=1 nnodes=1 node_rank=0 master_addr=127.0.0.1 master_port="" max_restarts=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nproc-per-node) nproc="$2"; shift 2 ;;
    --nnodes) nnodes="$2"; shift 2 ;;
    --node-rank) node_rank="$2"; shift 2 ;;
    --master-addr) master_addr="$2"; shift 2 ;;
    --master-port) master_port="$2"; shift 2 ;;
    --max-restarts) max_restarts="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) echo "launch.sh: unknown option '$1' (script arguments go after --)" >&2; exit 2 ;;
  esac
done
for value in "$nproc" "$nnodes" "$node_rank" "$max_restarts"; do
  if ! [[ "$value" =~ ^[0-9]+$ ]]; then
    echo "launch.sh: '$value' is not a non-negative integer" >&2
    exit 2
  fi
done

# (Asked only when unset: a value already set is kept either way, and asking torch starts a
# Python that imports it, 1.5 s on a 2-core machine.)
if [[ -z "${OMP_NUM_THREADS:-}" ]] &&
  ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  export OMP_NUM_THREADS=1
fi
# NCCL fails fast through async error handling: its watchdog thread sees a collective that
# failed or outlived the process group's timeout, aborts the communicators and takes the
# process down, while wait() stays asynchronous, so collectives keep overlapping compute.
# (TORCH_NCCL_BLOCKING_WAIT=1 would make every wait() hold the host until the GPU finishes:
# a Python error where the wait failed, and no overlap; not set here.) gloo ignores it, so
# it is set on every machine; a value the user set wins.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"

# Pre-flight: a script built on scaletorch's load_config (or taking --validate-only itself, as
# 12_vision does) checks its config for the world it is about to get (nproc x nnodes) before
# any process starts, so a mistake is one line
# "error: ..." and exit status 2, not a traceback from every rank. SCALETORCH_PREFLIGHT=0
# skips it (the ranks then refuse the config themselves, with the same line, once).
preflight="${SCALETORCH_PREFLIGHT:-1}"
for arg in "$@"; do
  [[ "$arg" == "-h" || "$arg" == "--help" ]] && preflight=0
done
if [[ "$preflight" != 0 ]] && grep -q "load_config\|--validate-only" "$script"; then
  python "$script" --validate-only --world-size "$((nproc * nnodes))" "$@" || exit $?
fi

# torchrun (scripts/torchrun.py: the same, minus torchrun's traceback after a refused config)
cmd=(python "$(dirname "$0")/torchrun.py" --nproc-per-node "$nproc" --max-restarts "$max_restarts")
if [[ "$nnodes" -gt 1 ]]; then
  master_port="${master_port:-29500}"
  cmd+=(--nnodes "$nnodes" --node-rank "$node_rank" --rdzv-backend c10d
        --rdzv-endpoint "$master_addr:$master_port" --rdzv-id scaletorch)
else
  # One node: a free port chosen by torchrun unless one is given.
  if [[ -n "$master_port" ]]; then
    cmd+=(--master-addr "$master_addr" --master-port "$master_port")
  else
    cmd+=(--standalone)
  fi
fi
cmd+=("$script" "$@")
nccl="${TORCH_NCCL_BLOCKING_WAIT:+TORCH_NCCL_BLOCKING_WAIT=$TORCH_NCCL_BLOCKING_WAIT }"
nccl+="TORCH_NCCL_ASYNC_ERROR_HANDLING=$TORCH_NCCL_ASYNC_ERROR_HANDLING"
echo "+ ${OMP_NUM_THREADS:+OMP_NUM_THREADS=$OMP_NUM_THREADS }$nccl ${cmd[*]}"
exec "${cmd[@]}"

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
fail() { echo "error: $*" >&2; exit 2; }  # a mistake in the arguments: one line, status 2
if [[ ! -f "$script" ]]; then
  fail "script '$script' not found: give the path of a script, e.g. examples/00_single_device.py"
fi

# Every option is checked here, before torchrun (or even Python) starts: one line each.
nproc=1 nnodes=1 node_rank=0 master_addr=127.0.0.1 master_port="" max_restarts=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nproc-per-node|--nnodes|--node-rank|--master-addr|--master-port|--max-restarts)
      if [[ $# -lt 2 || "$2" == --* ]]; then
        fail "$1 needs a value (see scripts/launch.sh --help)"
      fi ;;&
    --nproc-per-node) nproc="$2"; shift 2 ;;
    --nnodes) nnodes="$2"; shift 2 ;;
    --node-rank) node_rank="$2"; shift 2 ;;
    --master-addr) master_addr="$2"; shift 2 ;;
    --master-port) master_port="$2"; shift 2 ;;
    --max-restarts) max_restarts="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) fail "unknown option '$1' (script arguments go after --)" ;;
  esac
done
for option in nproc-per-node:"$nproc" nnodes:"$nnodes" node-rank:"$node_rank" \
  max-restarts:"$max_restarts" master-port:"$master_port"; do
  name="${option%%:*}" value="${option#*:}"
  if [[ -n "$value" || "$name" != master-port ]] && ! [[ "$value" =~ ^[0-9]+$ ]]; then
    fail "--$name '$value' is not a non-negative integer"
  fi
  # bash's arithmetic is 64-bit: a longer number would wrap around (to another count of ranks)
  if [[ "$value" =~ ^0*[1-9][0-9]{9,}$ ]]; then
    fail "--$name $value is too large (at most 999999999)"
  fi
done
# 10# reads a number with leading zeros in base 10 (bash would take 010 as octal)
if (( 10#$nproc < 1 )); then
  fail "--nproc-per-node must be at least 1, got $nproc: it is the number of ranks on this node"
fi
if (( 10#$nnodes < 1 )); then
  fail "--nnodes must be at least 1, got $nnodes"
fi
if (( 10#$node_rank >= 10#$nnodes )); then
  fail "--node-rank $node_rank is not a node of --nnodes $nnodes (ranks 0 to $((10#$nnodes - 1)))"
fi
if [[ -n "$master_port" ]] && (( 10#$master_port < 1 || 10#$master_port > 65535 )); then
  fail "--master-port must be in 1..65535, got $master_port"
fi
# The node that serves the rendezvous (node rank 0) binds the master port: when that is this
# host, a port already in use would end in torchrun's EADDRINUSE traceback. Checked by binding
# it (as torch's TCPStore does, address reuse on) and letting it go at once.
if [[ -n "$master_port" && "$node_rank" -eq 0 ]] &&
  [[ "$master_addr" =~ ^(127\.|localhost$|::1$|0\.0\.0\.0$) || "$master_addr" == "${HOSTNAME:-}" ]]; then
  if ! python - "$master_addr" "$((10#$master_port))" <<'PY'
import socket, sys
addr, port = sys.argv[1], int(sys.argv[2])
family = socket.AF_INET6 if ":" in addr else socket.AF_INET
with socket.socket(family, socket.SOCK_STREAM) as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((addr, port))
    except OSError:
        sys.exit(1)
PY
  then
    fail "--master-port $master_port is in use on this host ($master_addr): give a free port," \
      "or leave --master-port out on one node (torchrun then picks one)"
  fi
fi

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

# Pre-flight: a script built on scaletorch's load_config (or taking --validate-only itself)
# checks its config for the world it is about to get (nproc x nnodes) before
# any process starts, so a mistake is one line
# "error: ..." and exit status 2, not a traceback from every rank. SCALETORCH_PREFLIGHT=0
# skips it (the ranks then refuse the config themselves, with the same line, once).
preflight="${SCALETORCH_PREFLIGHT:-1}"
for arg in "$@"; do
  [[ "$arg" == "-h" || "$arg" == "--help" ]] && preflight=0
done
if [[ "$preflight" != 0 ]] && grep -q "load_config\|--validate-only" "$script"; then
  # LOCAL_WORLD_SIZE: the ranks that will share this host's memory (its memory check)
  LOCAL_WORLD_SIZE="$((10#$nproc))" \
    python "$script" --validate-only --world-size "$((10#$nproc * 10#$nnodes))" "$@" || exit $?
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

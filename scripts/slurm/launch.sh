#!/usr/bin/env bash
# One node's share of a megatron-rails run: a torchrun for this node. train.sbatch starts it with
# `srun` (one task per node); without Slurm it runs the whole job on this machine (1 node).
#
#   scripts/slurm/launch.sh RUN.yaml [KEY=VALUE ...]
#
# The run config decides the mode (validated first, errors name the file and key):
#   parallelism.backend gloo -> CPU mode: megatron_rails.demo.train, world_size / SLURM_NNODES ranks per
#                               node, OMP_NUM_THREADS=1 (the mini configs; CI runs this)
#   parallelism.backend nccl -> GPU mode: megatron_rails.pretrain (Megatron-LM's pretrain_gpt.py with the
#                               balancer installed), topology.gpus_per_node ranks per node; the job must
#                               have parallelism.nodes nodes; needs MEGATRON_LM_DIR
# Rendezvous: master = first host of SLURM_JOB_NODELIST (scontrol show hostnames), port
# 20000 + SLURM_JOB_ID % 20000 (MASTER_PORT overrides), node rank SLURM_NODEID.
# Logs: every rank's stdout/stderr under $RUN_DIR/logs/node<N>/ (torchrun --log-dir --tee), local rank 0
# also on the console (MR_CONSOLE_RANKS=0,1,... to see more); CPU mode writes $RUN_DIR/result.json.
# Exit status: torchrun's (non-zero when any rank fails).
#
# Environment: MEGATRON_RAILS_PYTHON (default: the repo's .venv, else python3), RUN_DIR (default
# runs/<job name>-<job id>), MASTER_PORT, MEGATRON_LM_DIR, the NCCL settings in docs/slurm.md, and
# MR_DRY_RUN=1 (print the environment and the torchrun command of this node, start nothing; 0 or unset:
# run). Each is checked first (a port, a job id, decimal node counts), errors in one line.
set -euo pipefail

die() { echo "launch.sh: error: $*" >&2; exit 2; }
[ $# -ge 1 ] || die "usage: launch.sh RUN.yaml [KEY=VALUE ...]"
CONFIG=$1; shift
[ -n "$CONFIG" ] || die "an empty path; give a run config file"
[ ! -d "$CONFIG" ] || die "$CONFIG: is a directory, not a run config file"
[ ! -e "$CONFIG" ] || [ -f "$CONFIG" ] || die "$CONFIG: not a regular file (a pipe or a device); give a run config file"
[ -f "$CONFIG" ] || die "run config '$CONFIG' not found (working directory $(pwd))"

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${MEGATRON_RAILS_PYTHON:-}
if [ -z "$PY" ]; then if [ -x "$REPO/.venv/bin/python" ]; then PY=$REPO/.venv/bin/python; else PY=python3; fi; fi
command -v "$PY" > /dev/null || die "MEGATRON_RAILS_PYTHON=$PY: no such Python (give the interpreter that has megatron-rails)"

# validate once (as a run config: a policy or topology file is named as such), read the four values
# the launch needs
"$PY" -m megatron_rails.cli config show "$CONFIG" "$@" --megatron-args > /dev/null \
    || die "invalid run config $CONFIG (see above)"
INFO=$("$PY" -m megatron_rails.cli config show "$CONFIG" "$@" --get parallelism.backend \
       --get parallelism.world_size --get parallelism.nodes --get topology.gpus_per_node) \
    || die "invalid run config $CONFIG (see above)"
read -r BACKEND WORLD NODES GPN <<<"$(echo $INFO)"

NNODES=${SLURM_NNODES:-1}
NODE_RANK=${SLURM_NODEID:-0}
# decimal digits, read as base 10 (bash reads 08 as a bad octal number)
[[ "$NNODES" =~ ^[0-9]{1,6}$ && 10#$NNODES -ge 1 ]] || die "SLURM_NNODES=$NNODES is not a node count (>= 1)"
NNODES=$((10#$NNODES))
[[ "$NODE_RANK" =~ ^[0-9]{1,6}$ && 10#$NODE_RANK -lt $NNODES ]] \
    || die "SLURM_NODEID=$NODE_RANK is not a node of this job (0 .. $((NNODES - 1)))"
NODE_RANK=$((10#$NODE_RANK))
JOB_ID=${SLURM_JOB_ID:-$$}
[[ "$JOB_ID" =~ ^[0-9]{1,18}$ ]] || die "SLURM_JOB_ID=$JOB_ID is not a job id (decimal digits)"
if [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
else
    MASTER_ADDR=127.0.0.1
fi
MASTER_PORT=${MASTER_PORT:-$((20000 + 10#$JOB_ID % 20000))}
[[ "$MASTER_PORT" =~ ^[0-9]{1,5}$ && 10#$MASTER_PORT -ge 1 && 10#$MASTER_PORT -le 65535 ]] \
    || die "MASTER_PORT=$MASTER_PORT is not a TCP port (1 .. 65535)"
RUN_DIR=${RUN_DIR:-$(pwd)/runs/${SLURM_JOB_NAME:-local}-$JOB_ID}

if [ "$BACKEND" = gloo ]; then
    [ $((WORLD % NNODES)) = 0 ] || die "$CONFIG: world size $WORLD does not split over $NNODES Slurm nodes"
    NPROC=$((WORLD / NNODES))
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    ENTRY=(-m megatron_rails.demo.train --run-config "$CONFIG" --out "$RUN_DIR/result.json" "$@")
else
    [ "$NNODES" = "$NODES" ] || die "$CONFIG: the run config wants $NODES nodes x $GPN GPUs, this job has \
$NNODES node(s): sbatch --nodes $NODES (or override parallelism.nodes=$NNODES)"
    NPROC=$GPN
    [ -n "${MEGATRON_LM_DIR:-}" ] || [ "${MR_DRY_RUN:-0}" = 1 ] || die "GPU mode runs Megatron-LM's pretrain_gpt.py: set \
MEGATRON_LM_DIR to a Megatron-LM checkout (sbatch exports it to the job)"
    # rail-cluster defaults; every one can be overridden from the environment (docs/slurm.md)
    export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}  # Megatron: keep TP/SP comm in order
    export NCCL_CROSS_NIC=${NCCL_CROSS_NIC:-0}          # rings/trees stay on one rail across nodes
    export NCCL_PXN_DISABLE=${NCCL_PXN_DISABLE:-0}      # PXN: NVLink to the GPU on the peer's rail, then its NIC
    export NCCL_P2P_PXN_LEVEL=${NCCL_P2P_PXN_LEVEL:-2}  # use PXN for all-to-all sends whenever it helps
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
    [ -n "${NCCL_IB_HCA:-}" ] || echo "launch.sh: note: NCCL_IB_HCA is unset; list the rail NICs in GPU order" \
        "(e.g. mlx5_0,...,mlx5_7) so storage/management HCAs stay out" >&2
    ENTRY=(-m megatron_rails.pretrain --run-config "$CONFIG" "$@")
fi

CMD=("$PY" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC"
     --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --rdzv-id "$JOB_ID" --max-restarts 0
     --log-dir "$RUN_DIR/logs/node$NODE_RANK" --tee 3 --local-ranks-filter "${MR_CONSOLE_RANKS:-0}"
     "${ENTRY[@]}")
case "${MR_DRY_RUN:-}" in ""|0) DRY=0 ;; 1) DRY=1 ;; *) die "MR_DRY_RUN=$MR_DRY_RUN: expected 1 (dry run) or 0 / unset" ;; esac
if [ "$DRY" = 1 ]; then  # print what this node would run, start nothing
    env | grep -E '^(NCCL_|CUDA_DEVICE_MAX_CONNECTIONS|OMP_NUM_THREADS|TORCH_NCCL_)' | sort
    printf '%q ' "${CMD[@]}"; echo
    exit 0
fi
mkdir -p "$RUN_DIR/logs/node$NODE_RANK"
echo "launch.sh: node $NODE_RANK/$NNODES ($(hostname)): $NPROC ranks, backend $BACKEND, world $WORLD," \
     "master $MASTER_ADDR:$MASTER_PORT, logs $RUN_DIR/logs/node$NODE_RANK" >&2
exec "${CMD[@]}"

#!/usr/bin/env bash
# Multi-node training on SLURM: one torchrun per node, c10d rendezvous on the first node.
#
#   sbatch scripts/slurm_multinode.sh [--section.key=value ...]
#   CONFIG_FILE=train_configs/llama3_1b.toml sbatch --nodes=4 scripts/slurm_multinode.sh
#
# Each node runs run_train.sh with NNODES/NGPU set; torchrun's c10d rendezvous (RDZV_ENDPOINT)
# needs no fixed node ranks, so the same command works on every node. Adjust the #SBATCH lines
# (partition, account, time) to your cluster.
#SBATCH --job-name=torchllm
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --exclusive
#SBATCH --output=slurm-%j.out
set -euo pipefail

cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"

head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export RDZV_ENDPOINT="${head_node}:${MASTER_PORT:-29500}"
# A secret id, the same on every node (srun passes the environment on): a guessable one lets
# anyone who reaches the endpoint run code in the launchers. The network must be trusted.
export RDZV_ID="${RDZV_ID:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}"
export NNODES="$SLURM_NNODES"
gpus="${SLURM_GPUS_PER_NODE:-8}"
export NGPU="${gpus##*:}"  # SLURM may write "h100:8"
export LOG_RANK="${LOG_RANK:-0}"
# NCCL: fail fast on a hung collective instead of waiting for the default timeout.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1

# One task per node; each starts torchrun, which starts NGPU ranks.
srun --ntasks-per-node=1 --kill-on-bad-exit=1 ./run_train.sh "$@"

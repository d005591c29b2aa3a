#!/usr/bin/env bash
# Launch torchllm training through torchrun.
#
#   ./run_train.sh [--section.key=value ...]
#
# Environment (all optional):
#   CONFIG_FILE   TOML config (default: train_configs/debug_model.toml)
#   NGPU / NPROC  processes per node (default: number of CUDA devices, else 1)
#   LOG_RANK      ranks whose output is shown, e.g. 0 or 0,1 (default: 0)
#   LOG_DIR       keep torchrun's per-rank output and error files (tracebacks) in this folder
#                 (default: a temporary folder, removed at exit)
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT   multi-node static rendezvous
#   RDZV_ENDPOINT host:port for c10d rendezvous (elastic; then RDZV_ID names the job)
#   RDZV_ID       the c10d rendezvous id: random when unset on one node; several nodes need the
#                 same secret value (e.g. $(python -c 'import secrets; print(secrets.token_hex(16))'))
#
# Network: one node (the default, or a 127.0.0.1/localhost RDZV_ENDPOINT) listens on 127.0.0.1
# only. A multi-node launch listens on every interface, and torchrun's stores have no
# authentication (whoever reaches them and knows RDZV_ID can run code in the launcher): run it
# on a trusted network only, as torchrun's own docs say.
#
# torchrun runs inside `python -m torchllm.run` (torchllm/run/launch.py), which first checks the
# config (a mistake is one line and exit code 2), then starts the workers the standard way
# (`python -u -m torchllm.train ...`, on CPU as on GPU; one process, NGPU=1 on one node, trains
# in the launcher's own process, without torchrun's agent), prints a failure on any rank once
# (the first error, or a killed rank with its signal), and exits 0 when SIGTERM/SIGINT stopped
# the run and every worker saved and exited cleanly.
#
# Paths (CONFIG_FILE, --section.key=value, and the paths inside the TOML: dump_folder, local:
# datasets, initial_load_path, ...) resolve against the directory you run it from, like any
# command; the script does not change directory. CONFIG_FILE may also name a shipped config
# relative to this clone (train_configs/x.toml) when no such file is where you stand.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

CONFIG_FILE=${CONFIG_FILE:-"$here/train_configs/debug_model.toml"}
if [[ "$CONFIG_FILE" != /* && ! -e "$CONFIG_FILE" && -e "$here/$CONFIG_FILE" ]]; then
    CONFIG_FILE="$here/$CONFIG_FILE"
fi
# This clone's torchllm, wherever it is run from (as `cd` into it gave before).
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
# Processes per node: NGPU, else NPROC, else "devices" (the launcher counts the CUDA devices, or
# 1 without any, in the process that runs torchrun: no separate Python start just to count them).
NGPU=${NGPU:-${NPROC:-devices}}
LOG_RANK=${LOG_RANK:-0}
NNODES=${NNODES:-1}

launch=(--nproc_per_node="$NGPU" --nnodes="$NNODES" --local-ranks-filter="$LOG_RANK" --role=rank --tee=3)
if [ -n "${RDZV_ENDPOINT:-}" ]; then
    launch+=(--rdzv_backend=c10d --rdzv_endpoint="$RDZV_ENDPOINT")
    # Without RDZV_ID the launcher picks a random one (one node) or refuses (several).
    [ -z "${RDZV_ID:-}" ] || launch+=(--rdzv_id="$RDZV_ID")
elif [ "$NNODES" -gt 1 ]; then
    launch+=(--node_rank="${NODE_RANK:?set NODE_RANK for multi-node}" \
             --master_addr="${MASTER_ADDR:?set MASTER_ADDR for multi-node}" \
             --master_port="${MASTER_PORT:-29500}")
else
    launch+=(--standalone)
fi
[ -z "${LOG_DIR:-}" ] || launch+=(--log-dir="$LOG_DIR")

exec python -m torchllm.run "${launch[@]}" -- --job.config_file "$CONFIG_FILE" "$@"

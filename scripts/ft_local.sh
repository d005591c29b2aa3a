#!/usr/bin/env bash
# Fault-tolerant training on one machine: a torchft lighthouse and N replica groups.
#
#   scripts/ft_local.sh N_GROUPS [--section.key=value ...]     (overrides go to every group)
#
# Each group is one ./run_train.sh launch (its NGPU ranks) with --fault_tolerance.enable,
# --fault_tolerance.replica_id=R and --fault_tolerance.group_size=N_GROUPS; its output goes to
# $FT_LOG_DIR/replica_R.log (and its exit code to replica_R.code). The lighthouse listens on
# 127.0.0.1 only (torchft_lighthouse binds every interface, [::]:29510, unless told otherwise);
# when one already answers at $TORCHFT_LIGHTHOUSE, it is reused.
#
# Environment (all optional):
#   FT_REPLICAS            which replica ids to start (default: 0 .. N_GROUPS-1); to relaunch a
#                          dead group beside running ones: FT_REPLICAS=1 scripts/ft_local.sh 2 ...
#   FT_LOG_DIR             where the groups' logs go (default: ./outputs/ft_local)
#   TORCHFT_LIGHTHOUSE     the lighthouse's address (default http://localhost:29510)
#   FT_HEARTBEAT_TIMEOUT_MS  how long a silent group stays in the quorum (default 5000): the
#                          survivors' pause after a group dies
#   FT_JOIN_TIMEOUT_MS     how long a quorum waits for groups that heartbeat but have not
#                          joined yet, e.g. still loading (default 60000)
#   NGPU, CONFIG_FILE, LOG_RANK, ...  as for ./run_train.sh (per group)
set -euo pipefail
cd "$(dirname "$0")/.."

if [ $# -lt 1 ] || ! [[ "$1" =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: scripts/ft_local.sh N_GROUPS [--section.key=value ...]" >&2
    exit 2
fi
groups=$1; shift
export TORCHFT_LIGHTHOUSE=${TORCHFT_LIGHTHOUSE:-http://localhost:29510}
log_dir=${FT_LOG_DIR:-./outputs/ft_local}
mkdir -p "$log_dir"
port=${TORCHFT_LIGHTHOUSE##*:}; port=${port%%/*}

lighthouse_up() { python -c "import socket,sys; socket.create_connection(('127.0.0.1', $port), 1).close()" 2>/dev/null; }

lighthouse_pid=""
if ! lighthouse_up; then
    torchft_lighthouse --min_replicas 1 --bind "127.0.0.1:$port" \
        --heartbeat_timeout_ms "${FT_HEARTBEAT_TIMEOUT_MS:-5000}" \
        --join_timeout_ms "${FT_JOIN_TIMEOUT_MS:-60000}" >"$log_dir/lighthouse.log" 2>&1 &
    lighthouse_pid=$!
    for _ in $(seq 100); do lighthouse_up && break; sleep 0.1; done
    lighthouse_up || { echo "ft_local: the lighthouse did not start (see $log_dir/lighthouse.log)" >&2; exit 1; }
    echo "ft_local: lighthouse on 127.0.0.1:$port (pid $lighthouse_pid)"
fi

pids=()
replicas=${FT_REPLICAS:-$(seq 0 $((groups - 1)))}
stop() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; }
trap 'stop' INT TERM
for r in $replicas; do
    rm -f "$log_dir/replica_$r.code"
    # setsid: each group is a process group of its own (replica_R.pid names it), as on its own node
    setsid ./run_train.sh --fault_tolerance.enable=true --fault_tolerance.replica_id="$r" \
        --fault_tolerance.group_size="$groups" "$@" >"$log_dir/replica_$r.log" 2>&1 &
    pids+=($!)
    echo "$!" >"$log_dir/replica_$r.pid"
    echo "ft_local: replica group $r -> $log_dir/replica_$r.log (relaunch it: FT_REPLICAS=$r $0 $groups ...)"
done

code=0
i=0
for r in $replicas; do
    c=0; wait "${pids[$i]}" || c=$?
    echo "$c" >"$log_dir/replica_$r.code"
    echo "ft_local: replica group $r exited with code $c"
    [ "$c" -le "$code" ] || code=$c
    i=$((i + 1))
done
[ -z "$lighthouse_pid" ] || kill "$lighthouse_pid" 2>/dev/null || true
exit "$code"

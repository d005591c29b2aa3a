#!/usr/bin/env bash
# Fault-tolerant training on one machine: a torchft lighthouse and N replica groups.
#
#   scripts/ft_local.sh N_GROUPS [--section.key=value ...]     (overrides go to every group)
#
# Each group is one ./run_train.sh launch (its NGPU ranks) with --fault_tolerance.enable,
# --fault_tolerance.replica_id=R and --fault_tolerance.group_size=N_GROUPS; its output goes to
# $FT_LOG_DIR/replica_R.log (and its exit code to replica_R.code). The lighthouse listens on
# fault_tolerance.bind only (default 127.0.0.1; torchft_lighthouse binds every interface,
# [::]:29510, unless told otherwise), as the groups' heal servers do, on the run's own port (python -m torchllm.ft: from the run's name and dump folder) unless
# $TORCHFT_LIGHTHOUSE names one. When one already answers there it is reused, unless this script
# started it for another run (its record, $FT_LIGHTHOUSE_RECORDS/PORT, names the run): refused.
#
# Environment (all optional):
#   FT_REPLICAS            which replica ids to start (default: 0 .. N_GROUPS-1); to relaunch a
#                          dead group beside running ones: FT_REPLICAS=1 scripts/ft_local.sh 2 ...
#   FT_LOG_DIR             where the groups' logs go (default: ./outputs/ft_local)
#   TORCHFT_LIGHTHOUSE     the lighthouse's address (default: the run's, http://localhost:PORT)
#   FT_LIGHTHOUSE_RECORDS  where the run of each lighthouse started here is recorded (default:
#                          ${TMPDIR:-/tmp}/torchllm-ft-lighthouses-$UID)
#   FT_HEARTBEAT_TIMEOUT_MS  how long a silent group stays in the quorum (default 5000): the
#                          survivors' pause after a group dies
#   FT_JOIN_TIMEOUT_MS     how long a quorum waits for groups that heartbeat but have not
#                          joined yet, e.g. still loading (default 60000)
#   TORCHLLM_FT_SECRET     the run's shared secret (a heal is served to and loaded from groups
#                          with it only): default, one made when this script starts the run's
#                          lighthouse, kept beside its record (mode 600) for relaunches
#   NGPU, CONFIG_FILE, LOG_RANK, ...  as for ./run_train.sh (per group)
# Paths (FT_LOG_DIR, CONFIG_FILE, the overrides' paths) resolve against where you stand, as for
# ./run_train.sh. A relaunch (FT_REPLICAS=R, the run's lighthouse reused) appends to the group's
# log and registers itself beside the lighthouse's record: the launch that started the lighthouse
# keeps it up until the relaunch ends and reports the relaunch's exit code for that group.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"

if [ $# -lt 1 ] || ! [[ "$1" =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: scripts/ft_local.sh N_GROUPS [--section.key=value ...]" >&2
    exit 2
fi
groups=$1; shift
# The run's default lighthouse address and its label (name and dump folder), as run_train.sh's
# config file and these overrides give them; a config error is one line and exit 2.
config_file=${CONFIG_FILE:-"$here/train_configs/debug_model.toml"}
if [[ "$config_file" != /* && ! -e "$config_file" && -e "$here/$config_file" ]]; then
    config_file="$here/$config_file"  # as run_train.sh: a shipped config named from the clone
fi
# (checked as each group loads it: with fault_tolerance.enable and group_size)
run=$(python -m torchllm.ft --job.config_file "$config_file" --fault_tolerance.enable=true \
      --fault_tolerance.group_size="$groups" "$@") \
    || exit $?
run_label=$(tail -n 1 <<<"$run")
bind=$(tail -n 3 <<<"$run" | head -n 1)  # fault_tolerance.bind: the lighthouse listens there too
[[ "$bind" != *:* ]] || bind_host="[$bind]"
bind_host=${bind_host:-$bind}
probe=$bind; [ "$probe" != "0.0.0.0" ] || probe=127.0.0.1; [ "$probe" != "::" ] || probe=::1
export TORCHFT_LIGHTHOUSE=${TORCHFT_LIGHTHOUSE:-$(tail -n 2 <<<"$run" | head -n 1)}
log_dir=${FT_LOG_DIR:-./outputs/ft_local}
mkdir -p "$log_dir"
port=${TORCHFT_LIGHTHOUSE##*:}; port=${port%%/*}
records=${FT_LIGHTHOUSE_RECORDS:-${TMPDIR:-/tmp}/torchllm-ft-lighthouses-$(id -u)}
record="$records/$port"  # "PID<tab>RUN" of the lighthouse this script started on that port
secret_file="$record.secret"  # the run's shared secret (unless TORCHLLM_FT_SECRET is set)

# A process that still runs (a zombie, ended but not yet reaped by whoever started it, does not).
running() { kill -0 "$1" 2>/dev/null && ! [[ "$(cat "/proc/$1/stat" 2>/dev/null)" =~ ^[0-9]+\ \(.*\)\ Z ]]; }
lighthouse_up() { python -c "import socket,sys; socket.create_connection(('$probe', $port), 1).close()" 2>/dev/null; }
new_secret() { (umask 077; mkdir -p "$records"; chmod 700 "$records"
    python -c 'import secrets; print(secrets.token_hex(32))' >"$secret_file"); }

lighthouse_pid=""
relaunch=""  # this call reuses this run's lighthouse: its groups are relaunches
if lighthouse_up; then
    owner_pid=""; owner=""
    [ ! -f "$record" ] || IFS=$'\t' read -r owner_pid owner <"$record" || true
    if [ -n "$owner_pid" ] && kill -0 "$owner_pid" 2>/dev/null && [ "$owner" != "$run_label" ]; then
        echo "ft_local: the lighthouse at $TORCHFT_LIGHTHOUSE serves another run ($owner;" \
             "lighthouse pid $owner_pid, its record $record), not this one ($run_label):" \
             "replica groups train only with groups of their own run; unset TORCHFT_LIGHTHOUSE" \
             "(each run has a port of its own) or set it to a free port" >&2
        exit 2
    fi
    if [ -n "$owner_pid" ] && [ "$owner" = "$run_label" ]; then
        echo "ft_local: reusing this run's lighthouse at $TORCHFT_LIGHTHOUSE (pid $owner_pid)"
        relaunch=1
    else
        echo "ft_local: reusing the lighthouse at $TORCHFT_LIGHTHOUSE (not started by" \
             "ft_local.sh: at their first quorum the groups refuse peers of another run)"
    fi
else
    [ -n "${TORCHLLM_FT_SECRET:-}" ] || new_secret  # a new run: a new secret
    torchft_lighthouse --min_replicas 1 --bind "$bind_host:$port" \
        --heartbeat_timeout_ms "${FT_HEARTBEAT_TIMEOUT_MS:-5000}" \
        --join_timeout_ms "${FT_JOIN_TIMEOUT_MS:-60000}" >"$log_dir/lighthouse.log" 2>&1 &
    lighthouse_pid=$!
    mkdir -p "$records"  # recorded before it answers: a call that finds it finds its run too
    printf '%s\t%s\n' "$lighthouse_pid" "$run_label" >"$record"
    for _ in $(seq 100); do lighthouse_up && break; sleep 0.1; done
    lighthouse_up || { echo "ft_local: the lighthouse did not start (see $log_dir/lighthouse.log)" >&2; exit 1; }
    echo "ft_local: lighthouse on $bind_host:$port (pid $lighthouse_pid) for run $run_label"
fi
if [ -z "${TORCHLLM_FT_SECRET:-}" ]; then  # this run's secret, shared by its groups' launches
    [ -s "$secret_file" ] || new_secret
    TORCHLLM_FT_SECRET=$(cat "$secret_file")
    export TORCHLLM_FT_SECRET
fi

pids=()
replicas=${FT_REPLICAS:-$(seq 0 $((groups - 1)))}
stop() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; }
trap 'stop' INT TERM
for r in $replicas; do
    code_file="$(cd "$log_dir" && pwd)/replica_$r.code"
    rm -f "$code_file"
    log="$log_dir/replica_$r.log"
    if [ -n "$relaunch" ]; then  # the killed launch's lines stay; the lighthouse's launch waits for this one
        echo "=== ft_local: replica group $r relaunched $(date '+%F %T') ===" >>"$log"
        printf '%s\t%s\n' "$$" "$code_file" >"$record.relaunch.$r"
    else
        : >"$log"
    fi
    # setsid: each group is a process group of its own (replica_R.pid names it), as on its own node
    setsid "$here/run_train.sh" --fault_tolerance.enable=true --fault_tolerance.replica_id="$r" \
        --fault_tolerance.group_size="$groups" "$@" >>"$log" 2>&1 &
    pids+=($!)
    echo "$!" >"$log_dir/replica_$r.pid"
    echo "ft_local: replica group $r -> $log (relaunch it: FT_REPLICAS=$r $0 $groups ...)"
done

codes=()
i=0
for r in $replicas; do
    c=0; wait "${pids[$i]}" || c=$?
    codes+=("$c")
    echo "ft_local: replica group $r exited with code $c"
    i=$((i + 1))
done
code=0
i=0
for r in $replicas; do
    c=${codes[$i]}
    # A group relaunched beside this launch: the lighthouse serves it until it ends, and its
    # exit code is the group's.
    if [ -n "$lighthouse_pid" ] && [ -f "$record.relaunch.$r" ]; then
        relaunch_pid=""; relaunch_code=""
        IFS=$'\t' read -r relaunch_pid relaunch_code <"$record.relaunch.$r" || true
        if [ -n "$relaunch_pid" ] && running "$relaunch_pid"; then
            echo "ft_local: waiting for replica group $r's relaunch (pid $relaunch_pid) before stopping the lighthouse"
            while running "$relaunch_pid"; do sleep 1; done
        fi
        rc=$(cat "$relaunch_code" 2>/dev/null || true)
        if [[ "$rc" =~ ^[0-9]+$ ]]; then
            echo "ft_local: replica group $r's relaunch exited with code $rc (this launch's group: $c)"
            c=$rc
        fi
    fi
    echo "$c" >"$log_dir/replica_$r.code"
    [ "$c" -le "$code" ] || code=$c
    i=$((i + 1))
done
if [ -n "$lighthouse_pid" ]; then
    kill "$lighthouse_pid" 2>/dev/null || true
    rm -f "$record" "$secret_file" "$record".relaunch.*
fi
exit "$code"

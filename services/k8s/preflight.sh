#!/bin/sh
# ppsync preflight: one pod of a LeaderWorkerSet group. Every pod of the group
# runs this (preflight-lws.yaml runs it as an init container of the leader and
# of every worker, so serving starts only after it exits 0): torchrun, one node
# per pod, node rank = the pod's worker index, static rendezvous at the leader,
# whose torchrun agent hosts the store; then `ppsync run` on every rank.
#
# Everything comes from the environment:
#   LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX   set by LeaderWorkerSet
#   PPSYNC_GROUP_INDEX     the pod's LWS group (default 0): files go to group-<N>/
#   PPSYNC_NPROC_PER_NODE  ranks per pod, one per accelerator (default 1)
#   PPSYNC_PP_SIZE         ranks per PP group (default LWS_GROUP_SIZE: one stage
#                          per pod, tensor parallel inside a pod, as vLLM lays it out)
#   PPSYNC_DEVICE          cpu, cuda or xpu (default cpu); cuda / xpu run the
#                          device codec over NCCL / XCCL, as serving does
#   PPSYNC_PORT            the rendezvous port on the leader (default 29400)
#   PPSYNC_STEPS (2000), PPSYNC_SPEC (0), PPSYNC_MAX_NUM_REQS (64),
#   PPSYNC_TIMEOUT (30 s), PPSYNC_JOIN_TIMEOUT (300 s): `ppsync run`'s flags
#   PPSYNC_OUT_DIR         a volume (default /preflight): group-<N>/report.json
#                          (written by the leader) and group-<N>/dumps/
# Exit status: torchrun's, i.e. ppsync run's (0 every row delivered exactly,
# 1 a fault or a failed rank, 2 bad arguments or environment); the last line
# of the log says it, on every path. Every value is checked before torchrun
# starts (`ppsync run --check` for the flags, the layout and the device), so a
# bad one is exit 2 with one line naming it, never a worker's traceback.
set -eu

finish() {  # CODE: the log's last line, then exit
    echo "ppsync preflight: group ${group:-?} pod ${node:-?}: exit code $1"
    exit "$1"
}
fail() { echo "ppsync preflight: $*" >&2; finish 2; }
count() {  # NAME VALUE LOW [HIGH]: VALUE must be an integer in [LOW, HIGH]
    rule=">= $3${4:+ and <= $4}"
    case "$2" in '' | *[!0-9]*) fail "$1 = '$2' must be an integer $rule";; esac
    # at most 9 digits: the shell's test compares machine integers
    [ "${#2}" -le 9 ] || fail "$1 = $2 must be an integer $rule"
    [ "$2" -ge "$3" ] || fail "$1 = $2 must be $rule"
    [ -z "${4:-}" ] || [ "$2" -le "$4" ] || fail "$1 = $2 must be $rule"
}

leader=${LWS_LEADER_ADDRESS:-}
[ -n "$leader" ] || fail "LWS_LEADER_ADDRESS is not set (LeaderWorkerSet sets it in every pod)"
nnodes=${LWS_GROUP_SIZE:-}
node=${LWS_WORKER_INDEX:-}
count LWS_GROUP_SIZE "$nnodes" 1
count LWS_WORKER_INDEX "$node" 0
[ "$node" -lt "$nnodes" ] || fail "LWS_WORKER_INDEX = $node must be < LWS_GROUP_SIZE = $nnodes"
group=${PPSYNC_GROUP_INDEX:-0}
count PPSYNC_GROUP_INDEX "$group" 0
nproc=${PPSYNC_NPROC_PER_NODE:-1}
pp=${PPSYNC_PP_SIZE:-$nnodes}
port=${PPSYNC_PORT:-29400}
count PPSYNC_NPROC_PER_NODE "$nproc" 1
count PPSYNC_PORT "$port" 1 65535
count PPSYNC_PP_SIZE "$pp" 1
device=${PPSYNC_DEVICE:-cpu}
case "$device" in
    cpu) device_args="";;
    cuda | xpu) device_args="--device $device --codec device";;
    *) fail "PPSYNC_DEVICE = '$device' must be cpu, cuda or xpu";;
esac
out=${PPSYNC_OUT_DIR:-/preflight}/group-$group
mkdir -p "$out/dumps" 2>/dev/null || fail "PPSYNC_OUT_DIR: cannot make $out/dumps"

# `ppsync run`'s flags, checked by ppsync itself as rank 0 of this world
# shellcheck disable=SC2086 (device_args: zero or more words)
set -- --pp-size "$pp" $device_args \
    --steps "${PPSYNC_STEPS:-2000}" --spec "${PPSYNC_SPEC:-0}" \
    --max-num-reqs "${PPSYNC_MAX_NUM_REQS:-64}" --timeout "${PPSYNC_TIMEOUT:-30}" \
    --join-timeout "${PPSYNC_JOIN_TIMEOUT:-300}" --progress-every 30 \
    --report "$out/report.json" --dump-dir "$out/dumps"
check=0
why=$(RANK=0 LOCAL_RANK=0 WORLD_SIZE=$((nnodes * nproc)) MASTER_ADDR=$leader \
      MASTER_PORT=$port ppsync run --check "$@" 2>&1 >/dev/null) || check=$?
# ppsync's last line names the flag (argparse's usage lines before it are left out)
[ "$check" -eq 0 ] || fail "$(printf '%s\n' "$why" | tail -n 1)" \
    "(each flag comes from its PPSYNC_* variable)"

echo "ppsync preflight: group $group pod $node of $nnodes, $nproc rank(s) per pod," \
     "pp_size $pp, device $device, leader $leader:$port, files in $out"
torchrun --nnodes "$nnodes" --nproc-per-node "$nproc" --node-rank "$node" \
    --master-addr "$leader" --master-port "$port" --max-restarts 0 \
    -m ppsync run "$@" &
child=$!
# the kubelet stops a pod with SIGTERM to this shell: hand it on to torchrun's
# agent, which stops its workers
trap 'kill -TERM "$child" 2>/dev/null || true' TERM INT
code=0
wait "$child" || code=$?
while kill -0 "$child" 2>/dev/null; do  # a signal ended the wait, not torchrun
    code=0
    wait "$child" || code=$?
done
finish "$code"

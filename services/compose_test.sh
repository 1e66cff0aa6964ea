#!/usr/bin/env bash
# `make compose-test`: run the top-level docker-compose.yml for real, with
# podman, from a bare Debian machine (as root; there is no Docker engine and no
# image can be pulled).
#
#  1. installs podman, podman-compose, runc, netavark, aardvark-dns, iptables and
#     debootstrap, and writes /etc/containers/containers.conf (runc; default
#     ulimits within the hard limits: crun and podman's defaults are refused in
#     this sandbox);
#  2. builds a Debian bookworm base image with debootstrap (python3 3.11, as
#     the wheelhouse) and imports it (skipped when it exists: a cache);
#  3. builds the image from services/Dockerfile on it (wheelhouse: make
#     wheelhouse, run by the make target first);
#  4. run 1: three rank containers finish the workload, every one exits 0,
#     rank 0's table says 0 lost / 0 stale / 0 duplicated / 0 corrupt;
#  5. run 2: one container killed mid-run (podman kill): every other one exits
#     non-zero within timeout + 5 s, with an error naming the lost rank;
#  6. removes the containers, the network, the volume and the built image
#     (keeps the base image) even on failure.
#
# Prints the run's wall time, the image size, rank 0's table and how long
# each survivor took to fail after the kill.
set -euo pipefail
cd "$(dirname "$0")/.."

PROJECT="ppsync-ct$$"
BASE_IMAGE="localhost/ppsync-base-bookworm:latest"
APP_IMAGE="localhost/ppsync:latest"
TIMEOUT_S=10         # every rank's --timeout
VICTIM=1             # the rank whose container run 2 kills
log() { echo "compose-test: $*" >&2; }
since() { awk "BEGIN { printf \"%.2f\", $(date +%s.%N) - $1 }"; }
fail() { log "FAIL: $*"; exit 1; }

install_tools() {
    local need=()
    # netavark sets up the containers' network with iptables: without it every
    # container fails "netavark: No such file or directory"
    for tool in podman podman-compose runc debootstrap netavark aardvark-dns iptables; do
        command -v "$tool" > /dev/null || [ -x "/usr/lib/podman/$tool" ] || need+=("$tool")
    done
    if [ ${#need[@]} -gt 0 ]; then
        log "installing ${need[*]}"
        apt-get update -q
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
            podman podman-compose runc debootstrap netavark aardvark-dns iptables > /dev/null
    fi
    mkdir -p /etc/containers
    cat > /etc/containers/containers.conf <<'CONF'
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]

[engine]
runtime = "runc"

[network]
network_backend = "netavark"
CONF
}

debian_mirror() {
    # the first Debian (not security) mirror this machine's apt sources name
    local uri
    uri=$(grep -hs -E '^(URIs:|deb )' /etc/apt/sources.list.d/*.sources \
              /etc/apt/sources.list.d/*.list /etc/apt/sources.list \
          | grep -v security | grep -o -E 'https?://[^ ]+' | head -n 1 || true)
    echo "${uri:-http://deb.debian.org/debian}"
}

base_image() {
    if podman image exists "$BASE_IMAGE"; then
        log "base image $BASE_IMAGE exists (cached)"
        return
    fi
    local dir mirror
    dir=$(mktemp -d /tmp/ppsync-base.XXXXXX)
    mirror=$(debian_mirror)
    log "debootstrap bookworm from $mirror"
    debootstrap --variant=minbase \
        --include=python3,python3-venv,python3-pip,ca-certificates \
        bookworm "$dir" "$mirror" > "$dir.log" 2>&1 || { tail -20 "$dir.log"; rm -rf "$dir"; fail "debootstrap"; }
    tar -C "$dir" -c . | podman import - "$BASE_IMAGE" > /dev/null
    rm -rf "$dir" "$dir.log"
}

compose() { podman-compose -p "$PROJECT" "$@"; }

containers() {  # NAME per line, ordered by rank
    podman ps -a --filter "label=io.podman.compose.project=$PROJECT" --format '{{.Names}}' | sort
}

container_of() { containers | grep -E "rank$1(_|-)[0-9]+$"; }

cleanup() {
    set +e
    compose down -v > /dev/null 2>&1
    for c in $(containers); do podman rm -f "$c" > /dev/null 2>&1; done
    podman volume rm -f "${PROJECT}_reports" > /dev/null 2>&1
    podman network rm -f "${PROJECT}_default" > /dev/null 2>&1
    podman image rm -f "$APP_IMAGE" > /dev/null 2>&1
}

wait_exit() {  # CONTAINER TIMEOUT_S: its exit code, or fail when it runs past the bound
    local c=$1 deadline=$(( $(date +%s) + $2 ))
    while [ "$(podman inspect --format '{{.State.Running}}' "$c")" = "true" ]; do
        [ "$(date +%s)" -lt "$deadline" ] || fail "$c still running after $2 s"
        sleep 0.2
    done
    podman inspect --format '{{.State.ExitCode}}' "$c"
}

finished_s() {  # CONTAINER: when it exited, in seconds since the epoch (fractional)
    date -d "$(podman inspect --format '{{.State.FinishedAt}}' "$1" | sed -E 's/ [A-Z]+$//')" +%s.%N
}

[ "$(id -u)" = 0 ] || fail "run as root (podman as root, packages, containers.conf)"
[ -n "$(ls services/wheels/ppsync-*.whl 2>/dev/null)" ] || fail "services/wheels is empty: make wheelhouse"
trap cleanup EXIT
install_tools
base_image
export PPSYNC_BASE_IMAGE="$BASE_IMAGE"

log "building $APP_IMAGE on $BASE_IMAGE"
t0=$(date +%s.%N)
compose build > /tmp/$PROJECT-build.log 2>&1 || { tail -30 /tmp/$PROJECT-build.log; fail "build"; }
log "image built in $(since "$t0") s; size $(podman image inspect --format '{{.Size}}' "$APP_IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"

# run 1: a clean check
export PPSYNC_STEPS=3000 PPSYNC_TIMEOUT=$TIMEOUT_S PPSYNC_PROGRESS_S=5
t0=$(date +%s.%N)
compose up -d > /tmp/$PROJECT-up.log 2>&1 || { cat /tmp/$PROJECT-up.log; fail "up"; }
[ "$(containers | wc -l)" = 3 ] || fail "expected 3 containers, got: $(containers | tr '\n' ' ')"
for r in 0 1 2; do
    code=$(wait_exit "$(container_of $r)" 600)
    [ "$code" = 0 ] || { podman logs "$(container_of $r)" | tail -20; fail "rank $r exited $code"; }
done
wall=$(since "$t0")
table=$(podman logs "$(container_of 0)" 2>/dev/null)
echo "$table"
echo "$table" | grep -q -- "-> OK: 0 lost / 0 stale / 0 duplicated / 0 corrupt" || fail "rank 0's table is not OK"
[ "$(echo "$table" | grep -c -E '^ +[0-9]+ +0 (receiver|last) ')" = 3 ] || fail "expected 3 rank rows"
log "run 1: 3 ranks x $PPSYNC_STEPS steps, every container exited 0; compose up to last exit ${wall} s"
compose down -v > /dev/null 2>&1

# run 2: kill one container mid-run
export PPSYNC_STEPS=1000000 PPSYNC_PROGRESS_S=1
compose up -d > /tmp/$PROJECT-up.log 2>&1 || { cat /tmp/$PROJECT-up.log; fail "up (run 2)"; }
deadline=$(( $(date +%s) + 300 ))
until podman logs "$(container_of 0)" 2>&1 | grep -q "ppsync: step "; do
    [ "$(date +%s)" -lt "$deadline" ] || fail "rank 0 made no progress"
    sleep 0.2
done
podman kill "$(container_of $VICTIM)" > /dev/null
killed=$(date +%s.%N)
for r in 0 1 2; do
    [ "$r" = "$VICTIM" ] && continue
    c=$(container_of $r)
    code=$(wait_exit "$c" $(( TIMEOUT_S + 5 + 5 )))
    took=$(awk "BEGIN { printf \"%.2f\", $(finished_s "$c") - $killed }")
    err=$(podman logs "$c" 2>&1 | grep "^ppsync: rank" | tail -1)
    log "run 2: rank $r exited $code ${took} s after rank $VICTIM was killed: $err"
    [ "$code" != 0 ] || fail "rank $r exited 0 after rank $VICTIM was killed"
    awk "BEGIN { exit !($took <= $TIMEOUT_S + 5) }" || fail "rank $r took ${took} s"
    echo "$err" | grep -q -E "peer rank\(s\) $VICTIM \(global\)" || fail "rank $r did not name rank $VICTIM"
done
log "PASS"

#!/usr/bin/env bash
# compose.yaml end to end, on a machine without an image registry or PyPI in its containers.
#
#   sudo scripts/compose_e2e.sh            (about 10 minutes the first time; not part of `make test`)
#
# What it does, in order:
#   1. installs docker.io, docker-compose (1.29) and debootstrap with apt if they are missing;
#   2. starts dockerd if no engine answers (and then stops it again at the end, see below);
#   3. makes the base image $BASE_IMAGE with debootstrap (Debian bookworm minbase + python3,
#      python3-venv) and `docker import`, unless it exists already;
#   4. fills the wheelhouse docker/wheels/ on the host with `pip download` (setup.cfg's
#      install_requires pinned by constraints.txt; the host's pip must find torch's CPU build);
#   5. builds the real Dockerfile from them: --build-arg BASE=$BASE_IMAGE --build-arg WHEELS=1
#      (classic builder, low CPU shares);
#   6. `docker-compose up` of compose.yaml plus an override that gives the containers low CPU
#      shares (cpu_shares 64), with the link shaped to $NETEM_RATE: first one edge, then a fleet
#      (EDGES=$FLEET_EDGES, `--scale stage0=$FLEET_EDGES`);
#   7. after each, checks that every container exited 0, that each edge's run directory on stage0's
#      volume has metrics.jsonl with every iteration and stage1's has its config and final checkpoint;
#   8. `docker-compose down -v` (containers, the network, the volumes) after each.
# On any exit (success, failure, Ctrl-C) the trap does 8, removes temporary files, and, if this
# script started dockerd, stops it and removes what the engine added to the host: the bridges
# (docker0, br-*) and veths that were not there before, its iptables rules (the saved ruleset is
# restored), net.ipv4.ip_forward, and the low-CPU-weight cgroup it ran the engine in. Images
# stay (the next run reuses them; `docker image rm` removes them).
#
# Environment: NETEM_RATE [20mbit], NETEM_DELAY, NETEM_LOSS, NETEM_ALLOW_PARTIAL, SPLITRL_ARGS,
# CODEC_ROLLOUT/CODEC_FWD/CODEC_BWD (passed to compose.yaml, see there); FLEET_EDGES [2] (the fleet run's edges); PYTHON [python3] (its pip
# makes the wheelhouse; must be CPython 3.11, like the base image's); PIP_DOWNLOAD_ARGS (extra
# `pip download` options, e.g. "--extra-index-url https://download.pytorch.org/whl/cpu" where the
# host's pip does not know torch's CPU build); BASE_IMAGE [splitrl-base:bookworm]; MIRROR
# [http://deb.debian.org/debian]; PROJECT [splitrl-e2e] (compose project name); TIMEOUT [3600]
# (seconds for `up`); OUT [a new temporary directory] (logs and the copied run directories).
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $(id -u) == 0 ]] || { echo "compose_e2e.sh: needs root (apt, dockerd, debootstrap)" >&2; exit 1; }

NETEM_RATE="${NETEM_RATE:-20mbit}"
export NETEM_RATE
PYTHON="${PYTHON:-python3}"
BASE_IMAGE="${BASE_IMAGE:-splitrl-base:bookworm}"
IMAGE=splitrl:latest  # compose.yaml's image name
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
PROJECT="${PROJECT:-splitrl-e2e}"
TIMEOUT="${TIMEOUT:-3600}"
OUT="${OUT:-$(mktemp -d /tmp/splitrl-compose-e2e.XXXXXX)}"
mkdir -p "$OUT"
STATE="$(mktemp -d /tmp/splitrl-compose-state.XXXXXX)"  # what the cleanup needs
CGROUP=splitrl-compose-e2e  # the engine's parent cgroup, when this script starts the engine
DEFAULT_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

log() { printf '[compose-e2e %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { log "FAILED: $*" >&2; exit 1; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

started_engine=0
dockerd_pid=
made_policy_rc=0
rootfs=
compose_up=0
compose=(docker-compose -p "$PROJECT" -f compose.yaml -f "$STATE/low-cpu.yaml")

cleanup() {
    local rc=$?
    set +e
    trap - EXIT INT TERM
    if ((compose_up)); then
        log "docker-compose down -v"
        "${compose[@]}" down -v --remove-orphans --timeout 20 2>&1 | sed 's/^/  /'
    fi
    if ((made_policy_rc)); then rm -f /usr/sbin/policy-rc.d; fi
    if [[ -n "$rootfs" && -d "$rootfs" ]]; then
        # debootstrap mounts proc and sys inside the target; never delete through a mount
        findmnt -rn -o TARGET | grep -F "$rootfs" | sort -r | xargs -r -n1 umount -l
        if findmnt -rn -o TARGET | grep -qF "$rootfs"; then
            log "left $rootfs in place: something is still mounted inside it"
        else
            rm -rf "$rootfs"
        fi
    fi
    if ((started_engine)); then
        log "stopping the dockerd this script started (pid $dockerd_pid)"
        kill -TERM "$dockerd_pid" 2>/dev/null
        for _ in $(seq 60); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.5; done
        if kill -0 "$dockerd_pid" 2>/dev/null; then
            log "dockerd did not stop in 30 s: SIGKILL"
            kill -KILL "$dockerd_pid"
        fi
        # the engine's managed containerd is its child and goes with it; its own interfaces stay
        local dev
        for dev in $(ip -o link show | awk -F': ' '{ sub(/@.*/, "", $2); print $2 }'); do
            if [[ "$dev" =~ ^(docker0|br-[0-9a-f]+|veth[0-9a-f]+)$ ]] && ! grep -qxF "$dev" "$STATE/links.before"; then
                ip link delete "$dev" && log "removed interface $dev"
            fi
        done
        # The engine writes the filter and nat tables: restore both as they were (a table that had no
        # rules before comes back empty with ACCEPT policies; docker sets FORWARD to DROP).
        {
            for table in filter nat; do
                if grep -qx "\*$table" "$STATE/iptables.before"; then
                    sed -n "/^\*$table\$/,/^COMMIT\$/p" "$STATE/iptables.before"
                elif [[ $table == filter ]]; then
                    printf '*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n'
                else
                    printf '*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n'
                    printf ':POSTROUTING ACCEPT [0:0]\nCOMMIT\n'
                fi
            done
        } > "$STATE/iptables.restore"
        if iptables-restore < "$STATE/iptables.restore"; then
            log "iptables filter and nat tables restored to what they were before dockerd"
        else
            log "could not restore iptables; the ruleset before dockerd is in $OUT/iptables.before"
            cp "$STATE/iptables.before" "$OUT/iptables.before"
        fi
        if [[ -n "$(cat "$STATE/ip_forward.before" 2>/dev/null)" ]]; then
            sysctl -qw net.ipv4.ip_forward="$(cat "$STATE/ip_forward.before")"
        fi
        local dir
        for dir in /sys/fs/cgroup/*/"$CGROUP" /sys/fs/cgroup/"$CGROUP"; do
            [[ -d "$dir" ]] && find "$dir" -depth -type d -exec rmdir {} + 2>/dev/null
            [[ -d "$dir" ]] && log "cgroup $dir is still there (processes in it?)"
        done
    fi
    rm -rf "$STATE"
    if ((rc == 0)); then log "done; logs and run directories in $OUT"; else log "exit $rc; logs in $OUT"; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# -- 1. tools ------------------------------------------------------------------------------------
missing=()
command -v dockerd > /dev/null || missing+=(docker.io)
command -v docker-compose > /dev/null || missing+=(docker-compose)
command -v debootstrap > /dev/null || missing+=(debootstrap)
if ((${#missing[@]})); then
    log "installing ${missing[*]} with apt"
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        # the packages' postinst must not start services: this script starts (and stops) dockerd itself
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
        made_policy_rc=1
    fi
    nice -n 19 apt-get update -qq
    DEBIAN_FRONTEND=noninteractive nice -n 19 apt-get install -y -qq --no-install-recommends "${missing[@]}" \
        > "$OUT/apt.log" 2>&1 || { tail -20 "$OUT/apt.log"; die "apt-get install ${missing[*]}"; }
    if ((made_policy_rc)); then rm -f /usr/sbin/policy-rc.d; made_policy_rc=0; fi
fi
log "tools: $(command -v docker) ($(docker --version)), $(docker-compose --version)"

# -- 2. the engine -------------------------------------------------------------------------------
if docker info > /dev/null 2>&1; then
    log "a docker engine is already running: using it, and leaving it running"
else
    ip -o link show | awk -F': ' '{ sub(/@.*/, "", $2); print $2 }' > "$STATE/links.before"
    iptables-save > "$STATE/iptables.before" || die "iptables-save (the engine's rules could not be undone)"
    sysctl -n net.ipv4.ip_forward > "$STATE/ip_forward.before"
    # Low CPU weight for everything the engine runs (build steps and both containers): the compose
    # override's cpu_shares only weigh the containers against each other inside the engine's parent
    # cgroup, and that parent would otherwise weigh as much as any process on the host. The parent
    # gets cpu.shares 64 against a host process's 1024 (cgroup v2: cpu.weight 6 against 100).
    engine_opts=()
    if [[ -f /sys/fs/cgroup/cpu/cpu.shares ]]; then  # cgroup v1
        mkdir -p "/sys/fs/cgroup/cpu/$CGROUP" && echo 64 > "/sys/fs/cgroup/cpu/$CGROUP/cpu.shares" \
            && engine_opts+=(--cgroup-parent "/$CGROUP")
    elif [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then  # cgroup v2
        mkdir -p "/sys/fs/cgroup/$CGROUP" && echo 6 > "/sys/fs/cgroup/$CGROUP/cpu.weight" \
            && engine_opts+=(--cgroup-parent "/$CGROUP")
    fi
    ((${#engine_opts[@]})) || log "could not make a low-weight cgroup for the engine; containers get normal CPU weight"
    log "starting dockerd ${engine_opts[*]} (niced, in its own session: Ctrl-C reaches only this script)"
    started_engine=1
    setsid nice -n 19 dockerd --pidfile "$STATE/dockerd.pid" "${engine_opts[@]}" > "$OUT/dockerd.log" 2>&1 < /dev/null &
    dockerd_pid=$!
    for _ in $(seq 120); do
        docker info > /dev/null 2>&1 && break
        kill -0 "$dockerd_pid" 2>/dev/null || { tail -20 "$OUT/dockerd.log"; die "dockerd exited"; }
        sleep 0.5
    done
    docker info > /dev/null 2>&1 || { tail -20 "$OUT/dockerd.log"; die "dockerd did not answer within 60 s"; }
fi
log "engine: $(docker version -f 'server {{.Server.Version}}, API {{.Server.APIVersion}}')"

# -- 3. the base image ---------------------------------------------------------------------------
if docker image inspect "$BASE_IMAGE" > /dev/null 2>&1; then
    log "base image $BASE_IMAGE exists: reusing it"
else
    rootfs="$(mktemp -d /var/tmp/splitrl-rootfs.XXXXXX)"
    log "debootstrap bookworm minbase into $rootfs (about a minute)"
    t0=$(now)
    nice -n 19 debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$rootfs" "$MIRROR" > "$OUT/debootstrap.log" 2>&1 \
        || { tail -20 "$OUT/debootstrap.log"; die "debootstrap (log: $OUT/debootstrap.log)"; }
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" --numeric-owner --exclude='./proc/*' --exclude='./sys/*' --exclude='./dev/*' -c . \
        | docker import --change "ENV PATH=$DEFAULT_PATH" --change 'CMD ["bash"]' - "$BASE_IMAGE" > /dev/null
    rm -rf "$rootfs" && rootfs=
    log "base image $BASE_IMAGE imported in $(since "$t0") s"
fi

# -- 4. the wheelhouse ---------------------------------------------------------------------------
"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' 2> /dev/null \
    || die "$PYTHON is not CPython 3.11: its pip would fetch wheels the base image's python3 cannot use (set PYTHON)"
mapfile -t requirements < <("$PYTHON" -c "import configparser as c; p = c.ConfigParser(); p.read('setup.cfg'); \
print(p['options']['install_requires'].strip())")
log "wheelhouse docker/wheels/: pip download ${requirements[*]} setuptools wheel"
t0=$(now)
# shellcheck disable=SC2086
nice -n 19 "$PYTHON" -m pip download -q --only-binary=:all: -d docker/wheels -c constraints.txt \
    ${PIP_DOWNLOAD_ARGS:-} 'setuptools>=61' wheel "${requirements[@]}" > "$OUT/pip-download.log" 2>&1 \
    || { tail -20 "$OUT/pip-download.log"; die "pip download"; }
ls docker/wheels/torch-*+cpu-*.whl > /dev/null 2>&1 \
    || die "no CPU build of torch in docker/wheels/ (set PIP_DOWNLOAD_ARGS to an index that has it)"
log "wheelhouse: $(find docker/wheels -name '*.whl' | wc -l) wheels, $(du -sh docker/wheels | cut -f1), $(since "$t0") s"

# -- 5. the image --------------------------------------------------------------------------------
log "DOCKER_BUILDKIT=0 docker build --cpu-shares 64 --build-arg BASE=$BASE_IMAGE --build-arg WHEELS=1 -t $IMAGE ."
t0=$(now)
DOCKER_BUILDKIT=0 nice -n 19 docker build --cpu-shares 64 --build-arg BASE="$BASE_IMAGE" --build-arg WHEELS=1 \
    -t "$IMAGE" . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; die "docker build (log: $OUT/build.log)"; }
size=$(docker image inspect -f '{{.Size}}' "$IMAGE")
log "image $IMAGE built in $(since "$t0") s: $((size / 1000000)) MB"

# -- 6. compose up, 7. checks: one edge, then a fleet ---------------------------------------------
cat > "$STATE/low-cpu.yaml" <<'EOF'
# scripts/compose_e2e.sh only: the test run must not take CPU from anything else on the machine
version: "2.4"
services:
  stage1:
    cpu_shares: 64
  stage0:
    cpu_shares: 64
EOF
"${compose[@]}" config -q || die "docker-compose rejects compose.yaml"

# run NAME EDGES: `docker-compose up --scale stage0=EDGES` with EDGES in the environment; checks that every
# container exited 0 and that each edge's run directory holds every iteration; `down -v` after.
run() {
    local name=$1 edges=$2 t0 up_rc up_seconds id service code dir metrics iterations expected entry
    local -a found ids=()
    log "[$name] EDGES=$edges NETEM_RATE=$NETEM_RATE${NETEM_DELAY:+ NETEM_DELAY=$NETEM_DELAY}\
${NETEM_LOSS:+ NETEM_LOSS=$NETEM_LOSS} docker-compose -p $PROJECT -f compose.yaml -f <low-cpu override> up \
--no-build --scale stage0=$edges"
    compose_up=1
    t0=$(now)
    set +e
    EDGES=$edges timeout "$TIMEOUT" "${compose[@]}" up --no-build --no-color --scale stage0="$edges" 2>&1 \
        | tee "$OUT/$name-up.log"
    up_rc=${PIPESTATUS[0]}
    set -e
    up_seconds=$(since "$t0")
    ((up_rc != 124)) || die "[$name] docker-compose up did not finish within $TIMEOUT s"
    for service in stage1 stage0; do
        mapfile -t found < <("${compose[@]}" ps -q "$service")
        ((${#found[@]} > 0)) || die "[$name] no $service container"
        [[ $service == stage1 || ${#found[@]} == "$edges" ]] || die "[$name] ${#found[@]} stage0 containers, not $edges"
        for id in "${found[@]}"; do
            code=$(docker inspect -f '{{.State.ExitCode}}' "$id")
            log "[$name] $service $(docker inspect -f '{{.Name}}' "$id"): exit $code"
            [[ $code == 0 ]] || die "[$name] $service exited $code (log: $OUT/$name-up.log)"
            ids+=("$service:$id")
        done
    done
    rm -rf "${OUT:?}/$name"
    mkdir -p "$OUT/$name"
    for entry in "${ids[@]}"; do  # a service's containers share its volume: one copy each
        service=${entry%%:*}
        id=${entry#*:}
        [[ -d "$OUT/$name/$service-runs" ]] || docker cp "$id:/runs" "$OUT/$name/$service-runs" \
            || die "[$name] cannot copy $service's /runs volume"
    done
    log "[$name] docker-compose up: exit $up_rc after $up_seconds s"
    "${compose[@]}" down -v --remove-orphans --timeout 20 2>&1 | sed 's/^/  /'
    compose_up=0
    [[ -s "$OUT/$name/stage1-runs/train/config-stage1.json" ]] || die "[$name] no config-stage1.json from stage1"
    compgen -G "$OUT/$name/stage1-runs/train/checkpoints/stage1-iter*.pt" > /dev/null || die "[$name] no stage1 checkpoint"
    log "[$name] stage1 volume: $(cd "$OUT/$name/stage1-runs/train" && find . -type f | sort | tr '\n' ' ')"
    for dir in "$OUT/$name"/stage0-runs/*/; do
        metrics="$dir/metrics.jsonl"
        [[ -s "$metrics" ]] || die "[$name] no metrics.jsonl in $dir"
        iterations=$(wc -l < "$metrics")
        expected=$("$PYTHON" - "$dir/config-stage0.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
s = c.get("settings", c)
ppo = s.get("ppo", {})
steps = s.get("total_steps")
per = ppo.get("num_steps", 0) * s.get("env", {}).get("num_envs", 1) * s.get("schedule", {}).get("edges", 1)
print(steps // per if steps and per else "")
PY
)
        log "[$name] stage0 volume, $(basename "$dir"): $(cd "$dir" && find . -type f | sort | tr '\n' ' ')"
        [[ -z "$expected" || "$iterations" == "$expected" ]] \
            || die "[$name] $metrics has $iterations lines, expected $expected"
        "$PYTHON" - "$metrics" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    net = sum(v for k, v in r.items() if k.startswith("net/") and k.endswith("_bytes"))
    edge = f"edge {r['fleet/edge']} " if "fleet/edge" in r else ""
    print(f"  {edge}iteration {r.get('iteration')}: {r['time/iteration']:.1f} s, {r['charts/SPS']:.1f} steps/s, "
          f"link wait {r['time/link_wait']:.1f} s, {net / 1e6:.1f} MB on the link")
PY
    done
    (($(find "$OUT/$name/stage0-runs" -mindepth 1 -maxdepth 1 -type d | wc -l) == edges)) \
        || die "[$name] not $edges edge run directories on stage0's volume"
    log "[$name] PASS: every container exited 0; every edge's metrics.jsonl has every iteration; up took $up_seconds s"
}

run one-edge 1
# A fleet: stage1 with --edges N, stage0 scaled to N containers, each with a key pair and a place of its own
# and its own shaped link (docker/entrypoint.sh).
FLEET_EDGES="${FLEET_EDGES:-2}"
run fleet "$FLEET_EDGES"
log "PASS: one edge, and a fleet of $FLEET_EDGES"

#!/usr/bin/env bash
# The image's entrypoint: shape this container's interface, say what is in place, then run the command.
#
# Shaping (egress of NETEM_DEV, default eth0; needs cap_add NET_ADMIN), from the environment:
#   NETEM_RATE           link rate in tc units, e.g. 20mbit            (unset or empty: no rate)
#   NETEM_DELAY          delay added to every packet, e.g. 20ms        (needs the netem qdisc)
#   NETEM_LOSS           random loss, e.g. 0.1%                         (needs the netem qdisc)
#   NETEM_ALLOW_PARTIAL  1: where the kernel has no netem, apply the rate alone with tbf and warn
#                        that delay/loss are NOT in place. Default 0: refuse, and the container
#                        exits 1 before its stage starts, so no run claims a delay it never had.
# A rate alone needs no netem: `splitrl netem apply` falls back to tbf by itself.
# With none of the three set, nothing is applied (the container's default qdisc stays).
#
# Training settings, for `splitrl stage0|stage1|train|run` commands only (both stages must get
# the same ones: compose.yaml gives both services one environment):
#   SPLITRL_ARGS         extra options, split on whitespace, e.g. "--total-steps 1024 --threads 1"
#   CODEC_ROLLOUT, CODEC_FWD, CODEC_BWD
#                        wire codecs, each passed as one argument, e.g. CODEC_BWD=ef:density=0.02,values=int8
#                        (`splitrl codecs` lists them); unset or empty: the default, fp32
#   EDGES                a fleet of this many edges (default 1; see below), CLAIMS_DIR [/claims] where the
#                        stage0 containers claim their places, CLAIM_LEASE [60] seconds a claim outlives a
#                        holder that stopped renewing it, CLAIM_WAIT [CLAIM_LEASE + 30] seconds to wait for
#                        a free place
#
# `share-keys VAULT SERVER_DIR EDGE_DIR` instead of a command (compose.yaml's keys service): make the
# CURVE keys in VAULT once (`splitrl keys`: stage1's pair and stage0's, with EDGES > 1 also edge0 ..
# edgeN-1), then give stage1 only its part and the edges only theirs (`share_keys` below). No shaping.
#
# This file is also a library: sourced, it defines the functions and runs nothing (tests/test_entrypoint.py).
set -euo pipefail

# A fleet edge K runs its stage as uid EDGE_UID_BASE + K, the owner of its secret key (share_keys).
EDGE_UID_BASE=10000

edge_names() {  # the edge key names for $1 edges: stage0 alone, or edge0 .. edgeN-1 for a fleet
    local k
    if (($1 > 1)); then for ((k = 0; k < $1; k++)); do echo "edge$k"; done; else echo stage0; fi
}

# Give each container only its own secret. SERVER_DIR (stage1's volume) gets stage1.key_secret, stage1.key and
# authorized/ (the edges' public keys); EDGE_DIR (the stage0 containers' volume) gets stage1.key and the
# current edges' secrets, nothing else: a fleet edge K's secret is owned by its uid (EDGE_UID_BASE + K), mode
# 0600, so no other edge's stage can read it. Files are written under umask 077, so no secret is ever readable
# by others, and each call replaces what an earlier one shared (fewer edges: the others' secrets go).
share_keys() {
    local vault=$1 server=$2 edge_dir=$3 edges=$4 name entry k=0
    local -A keep=([stage1.key]=1)
    for name in $(edge_names "$edges"); do keep[$name.key_secret]=1; done
    (
        umask 077
        rm -f "$server/stage1.key_secret"
        cp "$vault/stage1.key_secret" "$server/"
        cp "$vault/stage1.key" "$server/"
        chmod 0644 "$server/stage1.key"
        rm -rf "$server/authorized"
        cp -r "$vault/authorized" "$server/"
        chmod 0755 "$server/authorized"
        chmod 0644 "$server"/authorized/*.key
        for entry in "$edge_dir"/* "$edge_dir"/.[!.]*; do
            if [[ -e "$entry" && -z "${keep[${entry##*/}]:-}" ]]; then rm -rf "$entry"; fi
        done
        chmod 0755 "$edge_dir"
        cp "$vault/stage1.key" "$edge_dir/"
        chmod 0644 "$edge_dir/stage1.key"
        for name in $(edge_names "$edges"); do
            rm -f "$edge_dir/$name.key_secret"
            cp "$vault/$name.key_secret" "$edge_dir/"
            if ((edges > 1 && EUID == 0)); then
                chown "$((EDGE_UID_BASE + k)):$((EDGE_UID_BASE + k))" "$edge_dir/$name.key_secret"
            fi
            k=$((k + 1))
        done
    )
}

make_and_share_keys() {  # VAULT SERVER_DIR EDGE_DIR: compose.yaml's keys service
    local vault=$1 name
    test -e "$vault/stage1.key_secret" || splitrl keys "$vault"
    if ((${EDGES:-1} > 1)); then
        for name in $(edge_names "$EDGES"); do
            test -e "$vault/$name.key_secret" || splitrl keys "$vault" --name "$name"
        done
    fi
    share_keys "$vault" "$2" "$3" "${EDGES:-1}"
    echo "entrypoint: keys shared: $2 (stage1's) and $3 ($(edge_names "${EDGES:-1}" | tr '\n' ' ')each its own)"
}

# -- a fleet's places ---------------------------------------------------------------------------------------
# A place K is the directory CLAIMS_DIR/edgeK (mkdir is atomic: one container wins it) holding `holder`, a
# line naming the container. Its holder renews holder's time while it runs (keep_claim) and removes the claim
# as it exits (release_place; `run_holding` does both). A claim not renewed for CLAIM_LEASE seconds is a holder
# gone without a word (SIGKILL, a host lost) and is taken over, so `docker compose up` after `down` (without
# -v) finds every place free again, at worst after one lease.
claims_dir="${CLAIMS_DIR:-/claims}"
claim_lease="${CLAIM_LEASE:-60}"
place=
claim=
claim_token=

claim_is_stale() {  # $1: a claim directory; stale when its holder (or, before one is written, it) is old
    local stamp="$1/holder" mtime
    [[ -e "$stamp" ]] || stamp=$1
    mtime=$(stat -c %Y "$stamp" 2> /dev/null) || return 1
    (($(date +%s) - mtime > claim_lease))
}

claim_place() {  # $1 places: claims the first free (or stale) one; sets place and claim, or returns 1
    local places=$1 k dir deadline=$((SECONDS + ${CLAIM_WAIT:-$((claim_lease + 30))}))
    claim_token="$HOSTNAME $$ $RANDOM$RANDOM"
    mkdir -p "$claims_dir"
    while :; do
        for ((k = 0; k < places; k++)); do
            dir="$claims_dir/edge$k"
            if ! mkdir "$dir" 2> /dev/null; then
                claim_is_stale "$dir" || continue
                # Take it over: the rename succeeds for one taker only; then the place is free for mkdir. A taker
                # that renamed a claim made fresh meanwhile (by another taker) puts it back.
                local gone="$dir.gone.$RANDOM$RANDOM"
                mv -T "$dir" "$gone" 2> /dev/null || continue
                if ! claim_is_stale "$gone"; then
                    mv -T "$gone" "$dir" 2> /dev/null || rm -rf "$gone"
                    continue
                fi
                echo "entrypoint: place $k's claim ($(cat "$gone/holder" 2> /dev/null || echo no holder)) was not" \
                    "renewed for ${claim_lease} s: taking it over" >&2
                rm -rf "$gone"
                mkdir "$dir" 2> /dev/null || continue
            fi
            printf '%s\n' "$claim_token" > "$dir/holder"
            place=$k
            claim=$dir
            return 0
        done
        ((SECONDS < deadline)) || return 1
        sleep 2
    done
}

holds_claim() { [[ -n "$claim" && "$(cat "$claim/holder" 2> /dev/null)" == "$claim_token" ]]; }

keep_claim() {  # renews the claim every quarter lease while the entrypoint lives and the claim is still its
    local nap=
    trap '[[ -n "$nap" ]] && kill "$nap" 2> /dev/null; exit 0' TERM  # stopped: its sleep goes too, not a lease later
    while :; do
        sleep $(((claim_lease + 3) / 4)) &
        nap=$!
        wait "$nap" && kill -0 "$$" 2> /dev/null && holds_claim || break
        touch "$claim/holder"
    done
}

release_place() {  # removes the claim if it is still this container's
    if holds_claim; then rm -rf "$claim"; fi
    claim=
}

# Runs the command holding the claim: renewed while it runs, released when it ends, however the container is
# stopped (TERM and INT are passed on to it). Exits with the command's status.
run_holding() {
    local child keeper rc forwarded=0
    keep_claim &
    keeper=$!
    "$@" &
    child=$!
    trap 'forwarded=1; kill -TERM "$child" 2> /dev/null || true' TERM INT
    while :; do
        forwarded=0
        wait "$child" && rc=0 || rc=$?
        ((forwarded)) || break  # a signal interrupted the wait: wait again for the command's own status
    done
    trap - TERM INT
    kill "$keeper" 2> /dev/null || true
    release_place
    exit "$rc"
}

main() {
    if [[ "${1:-}" == share-keys ]]; then
        shift
        make_and_share_keys "$@"
        exit 0
    fi

    local dev="${NETEM_DEV:-eth0}"
    local -a shape=()
    if [[ -n "${NETEM_RATE:-}" ]]; then shape+=(--rate "$NETEM_RATE"); fi
    if [[ -n "${NETEM_DELAY:-}" ]]; then shape+=(--delay "$NETEM_DELAY"); fi
    if [[ -n "${NETEM_LOSS:-}" ]]; then shape+=(--loss "$NETEM_LOSS"); fi

    if ((${#shape[@]})); then
        if [[ "${NETEM_ALLOW_PARTIAL:-0}" == 1 ]]; then shape+=(--allow-partial); fi
        echo "entrypoint: splitrl netem apply --dev $dev ${shape[*]}"
        if ! splitrl netem apply --dev "$dev" "${shape[@]}"; then
            echo "entrypoint: shaping $dev failed (see above); not starting '$*'" >&2
            exit 1
        fi
    fi
    echo "entrypoint: in place on $dev: $(splitrl netem show --dev "$dev")"

    local -a run=()
    if [[ "${1:-}" == splitrl ]]; then
        case "${2:-}" in
            stage0|stage1|train|run)
                local -a extra
                set -f  # SPLITRL_ARGS is split on whitespace, never globbed
                # shellcheck disable=SC2206
                extra=(${SPLITRL_ARGS:-})
                set +f
                local stream var
                for stream in rollout fwd bwd; do
                    var="CODEC_${stream^^}"
                    if [[ -n "${!var:-}" ]]; then extra+=("--codec-$stream" "${!var}"); fi
                done
                # A fleet (EDGES > 1, compose's --scale stage0=EDGES): stage1 serves EDGES edges; each stage0
                # claims a free place K (above) and takes it (--edge-id K), with the key pair edgeK where the
                # link uses CURVE and its run directory /runs/edgeK. As root (the image's default) it runs its
                # stage as uid EDGE_UID_BASE + K, which may read edgeK's secret and no other edge's. Later
                # options win over the command's own.
                local edges="${EDGES:-1}"
                if ((edges > 1)); then
                    extra+=(--edges "$edges")
                    if [[ "$2" == stage0 ]]; then
                        if ! claim_place "$edges"; then
                            echo "entrypoint: all $edges places of the fleet are claimed ($claims_dir); not starting" >&2
                            exit 1
                        fi
                        trap release_place EXIT
                        # Stopped before the command runs (run_holding's trap takes over then): exit as a stopped
                        # command would, 128 + the signal, the claim released on the way out.
                        trap 'exit 143' TERM
                        trap 'exit 130' INT
                        echo "entrypoint: this container is edge $place of $edges"
                        extra+=(--edge-id "$place" --run-dir "/runs/edge$place")
                        if [[ " $* " == *" --curve "* ]]; then extra+=(--curve-name "edge$place"); fi
                        if ((EUID == 0)); then
                            local uid=$((EDGE_UID_BASE + place))
                            mkdir -p "/runs/edge$place"
                            chown -R "$uid:$uid" "/runs/edge$place"
                            run=(setpriv --reuid "$uid" --regid "$uid" --clear-groups --inh-caps=-all
                                 --bounding-set=-all --no-new-privs -- env HOME=/tmp)
                        fi
                    fi
                fi
                set -- "$@" "${extra[@]}"
                ;;
        esac
    fi
    if [[ -n "$claim" ]]; then
        echo "entrypoint: run ${run[*]:+${run[*]} }$* (holding $claim)"
        run_holding "${run[@]}" "$@"
    fi
    echo "entrypoint: exec $*"
    exec "$@"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then main "$@"; fi

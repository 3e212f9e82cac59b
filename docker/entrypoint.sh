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
#                        stage0 containers claim their places
set -euo pipefail

dev="${NETEM_DEV:-eth0}"
shape=()
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

if [[ "${1:-}" == splitrl ]]; then
    case "${2:-}" in
        stage0|stage1|train|run)
            set -f  # SPLITRL_ARGS is split on whitespace, never globbed
            # shellcheck disable=SC2206
            extra=(${SPLITRL_ARGS:-})
            set +f
            for stream in rollout fwd bwd; do
                var="CODEC_${stream^^}"
                if [[ -n "${!var:-}" ]]; then extra+=("--codec-$stream" "${!var}"); fi
            done
            # A fleet (EDGES > 1, compose's --scale stage0=EDGES): stage1 serves EDGES edges; each stage0
            # claims the first free place K on the shared claims volume (mkdir is atomic) and takes it
            # (--edge-id K), with the key pair edgeK where the link uses CURVE and its run directory
            # /runs/edgeK. Later options win over the command's own.
            edges="${EDGES:-1}"
            if ((edges > 1)); then
                extra+=(--edges "$edges")
                if [[ "$2" == stage0 ]]; then
                    mkdir -p "${CLAIMS_DIR:-/claims}"
                    place=
                    for ((k = 0; k < edges; k++)); do
                        if mkdir "${CLAIMS_DIR:-/claims}/edge$k" 2> /dev/null; then place=$k; break; fi
                    done
                    if [[ -z "$place" ]]; then
                        echo "entrypoint: all $edges places of the fleet are claimed (${CLAIMS_DIR:-/claims}); not starting" >&2
                        exit 1
                    fi
                    echo "entrypoint: this container is edge $place of $edges"
                    extra+=(--edge-id "$place" --run-dir "/runs/edge$place")
                    if [[ " $* " == *" --curve "* ]]; then extra+=(--curve-name "edge$place"); fi
                fi
            fi
            set -- "$@" "${extra[@]}"
            ;;
    esac
fi
echo "entrypoint: exec $*"
exec "$@"

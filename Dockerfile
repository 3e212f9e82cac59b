# One image for both stages: splitrl in a venv at /opt/venv, tc (iproute2) for shaping, setpriv
# (util-linux) for a fleet edge's own uid, and docker/entrypoint.sh, which shapes eth0 from NETEM_*
# variables before running the command.
# compose.yaml runs two containers of it, stage1 and stage0, on a bridge network.
#
# Anywhere with network access (python:3.11-slim; the Python dependencies from PyPI, pinned by
# constraints.txt; torch's CPU build from the PyTorch CPU index, not PyPI's multi-GB CUDA build):
#
#   docker build -t splitrl .            (or just: docker compose up)
#
# Without PyPI (what scripts/compose_e2e.sh does): any base with python3 3.11, its venv module and
# apt, e.g. one made with debootstrap, and a wheelhouse of the dependencies in docker/wheels/:
#
#   docker build --build-arg BASE=splitrl-base:bookworm --build-arg WHEELS=1 -t splitrl .
#
# Both ways build the same venv the same way; only where pip finds the wheels differs.

ARG BASE=python:3.11-slim

# -- the dependencies, in a venv; only the venv goes on --------------------------------------
FROM ${BASE} AS deps
ARG WHEELS=0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
# docker/wheel[s] matches nothing in a checkout without a wheelhouse; then only the two files come.
# A wheelhouse's files land in /build beside them, and leave with this stage.
COPY setup.cfg constraints.txt docker/wheel[s] /build/
# The requirements are setup.cfg's install_requires (one list to keep), pinned by constraints.txt.
# setuptools and wheel are there to build splitrl itself below without build isolation (no index).
RUN set -eu; \
    if [ "$WHEELS" = 1 ]; then src="--no-index --find-links /build"; else src="--extra-index-url $TORCH_INDEX"; fi; \
    python3 -c "import configparser as c; p = c.ConfigParser(); p.read('/build/setup.cfg'); \
print(p['options']['install_requires'])" > /build/requirements.txt; \
    python3 -m venv /opt/venv; \
    /opt/venv/bin/pip install $src 'setuptools>=61' wheel; \
    /opt/venv/bin/pip install $src -c /build/constraints.txt -r /build/requirements.txt; \
    /opt/venv/bin/python -c "import torch; assert not torch.version.cuda, 'a CUDA build of torch was installed'"

# -- the image ----------------------------------------------------------------------------------
FROM ${BASE}
# PATH in full: an imported base image may carry no PATH of its own.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 \
    PYGAME_HIDE_SUPPORT_PROMPT=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends iproute2 util-linux \
    && rm -rf /var/lib/apt/lists/*
COPY --from=deps /opt/venv /opt/venv
WORKDIR /src
COPY pyproject.toml setup.cfg README.md ./
COPY splitrl ./splitrl
RUN pip install --no-deps --no-build-isolation . && rm -rf build ./*.egg-info && splitrl --help > /dev/null
COPY docker/entrypoint.sh /usr/local/bin/splitrl-entrypoint
RUN chmod 0755 /usr/local/bin/splitrl-entrypoint
WORKDIR /runs
ENTRYPOINT ["splitrl-entrypoint"]
CMD ["splitrl", "--help"]

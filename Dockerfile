# syntax=docker/dockerfile:1
#
# One image for the three roles that every manifest starts from ghcr.io/kvserve/kvserve:TAG:
# the operator (`kvserve-operator run`), the runtime (`kvserve serve`) and the sidecar agent
# (`kvserve agent ...`). The manifests set each container's command, so the image has no
# entrypoint of its own.
#
#   docker build -t kvserve:dev .                                   # CUDA (PyPI's torch)
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
#                -t kvserve:dev-cpu .                               # CPU only (kind, laptops)
#
# docs/install.md ("Build the image") says how to load it into kind or push it.

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS wheel
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY runtime runtime
COPY kernels kernels
COPY operator operator
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:${PYTHON_VERSION}-slim-bookworm
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://pypi.org/simple
# Triton compiles its small kernel-launcher module with the system C compiler on first use.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
# torch first, from the chosen index, so that kvserve's own `torch>=...` is already satisfied
# and pip does not swap a CPU build for PyPI's CUDA one.
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-cache-dir "$(ls /wheels/kvserve-*.whl)[triton,events]"
# The pods run with a read-only root filesystem: caches go to the /tmp emptyDir the operator
# mounts (the same variables are set on every container it makes).
ENV HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    TRITON_CACHE_DIR=/tmp/.triton \
    PYTHONUNBUFFERED=1
# A named user (not a bare uid) so that getpass.getuser() works for torch and Triton.
RUN groupadd --gid 65532 kvserve \
 && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin kvserve
USER 65532:65532
# runtime (OpenAI API and /metrics), agent, operator liveness, operator metrics
EXPOSE 8000 8081 8080 8082
CMD ["kvserve", "--help"]

# lorabus: the control plane's services (coordinator, agent, tap, provision,
# update) and, with the sim extra, nats-server and the simulated Dynamo fleet,
# so one image runs every service of compose.yaml.
#
#   docker build -t lorabus .
#   podman build --build-arg BASE_IMAGE=localhost/debian:bookworm -t lorabus .
#
# BASE_IMAGE needs python3 (3.11 or later) with its venv module: a python slim
# image, or plain Debian bookworm with python3-venv (what scripts/setup-containers
# builds where no registry can be reached). Everything is installed into a venv,
# so the same steps work on both.
ARG BASE_IMAGE=python:3.11-slim

# Stage 1: the wheel, built from the source tree; nothing of the tree goes further.
FROM ${BASE_IMAGE} AS build
COPY . /src
RUN python3 -m venv /opt/build \
    && /opt/build/bin/pip wheel --quiet --no-cache-dir --no-deps --wheel-dir /dist /src

# Stage 2: the wheel installed, with the sim extra, as a non-root user.
FROM ${BASE_IMAGE}
ARG BASE_IMAGE
ARG VERSION=dev
LABEL org.opencontainers.image.title="lorabus" \
      org.opencontainers.image.description="Roll LoRA adapters out across a fleet of inference workers over a NATS bus" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="NOASSERTION" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"

ENV PATH=/opt/lorabus/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The dependencies first, from pyproject.toml alone: a change to the code then
# rebuilds only the small layer below, not numpy and friends.
COPY pyproject.toml /tmp/pyproject.toml
RUN python3 -m venv /opt/lorabus \
    && python3 -c 'import tomllib; p = tomllib.load(open("/tmp/pyproject.toml", "rb"))["project"]; print("\n".join(p["dependencies"] + p["optional-dependencies"]["sim"]))' > /tmp/requirements.txt \
    && /opt/lorabus/bin/pip install --quiet --no-cache-dir -r /tmp/requirements.txt \
    && rm /tmp/pyproject.toml /tmp/requirements.txt

COPY --from=build /dist/ /tmp/dist/
RUN wheel="$(ls /tmp/dist/lorabus-*.whl)" \
    && /opt/lorabus/bin/pip install --quiet --no-cache-dir "${wheel}[sim]" \
    && rm -rf /tmp/dist \
    && lorabus --version \
    && nats-server --version

# Mount points owned by the service user, so that a fresh named volume mounted
# on them is writable by it (the engine copies their ownership into the volume).
RUN groupadd --gid 10001 lorabus \
    && useradd --uid 10001 --gid 10001 --home-dir /var/lib/lorabus --create-home lorabus \
    && mkdir -p /data /trail /adapters /auth /provisioned \
    && chown lorabus:lorabus /data /trail /adapters /auth /provisioned

USER lorabus
WORKDIR /var/lib/lorabus
# 4222 NATS clients, 6222 NATS routes, 8222 NATS monitoring, 8000 the sim fleet.
EXPOSE 4222 6222 8222 8000
CMD ["lorabus", "--help"]

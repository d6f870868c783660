# Stand-in for the official `prom/prometheus` image where no registry can be reached (used by
# `make compose-check`, compose/README.md "Offline"): Debian's `prometheus` package on a Debian-based
# image (BASE_IMAGE). Like the official image: the server is the entrypoint (compose gives its flags),
# it runs as `nobody` and keeps its data in /prometheus; wget for the compose healthcheck.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends prometheus wget \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /prometheus \
    && chown nobody:nogroup /prometheus
USER nobody
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]

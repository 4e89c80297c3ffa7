# HAProxy 2.6 from Debian 12's package, for the fleet profile of docker-compose.yaml: the same build as the
# `haproxy` that `resnet18-kit fleet` runs, on the same base as the Triton image (BASE_IMAGE, see Dockerfile).
# Built by `resnet18-kit docker image --with fleet` (or compose) with the host's network, which reaches the
# Debian mirror. Its configuration is mounted: deploy/haproxy/haproxy.cfg + servers-compose.cfg.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends haproxy >/dev/null \
    && rm -rf /var/lib/apt/lists/*
USER haproxy
# -W master-worker, -db foreground: SIGTERM is a hard stop, SIGUSR1 a soft one (compose: stop_signal).
ENTRYPOINT ["haproxy", "-W", "-db"]

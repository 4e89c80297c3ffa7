#!/usr/bin/env bash
# Set-up in layers: each installs what its make target uses, says what before it does, and is idempotent (a
# second run with nothing changed installs nothing). Versions: constraints.txt; extras: pyproject.toml.
#
#   scripts/setup.sh demo    `make demo`, `make serve`: a venv in .venv/ with the package's `serve` and `export`
#                            extras (tritonserver 2.51 from PyTriton's wheel, ONNX Runtime, OpenVINO, torch,
#                            torchvision, the sample photos) and Debian's libpython3.11 (the Python-backend stub
#                            embeds it). No Docker, HAProxy or Prometheus.
#   scripts/setup.sh check   `make check`, the fast tier: demo + the `test` extra (pytest, import-linter, pylint,
#                            tritonclient[all] with perf_analyzer, matplotlib) + Debian's libb64-0d (perf_analyzer)
#                            and xz-utils (bench gpu-pack).
#   scripts/setup.sh test    `make test`, the whole suite: check + the deployment tools and a Docker engine
#                            (scripts/setup_deploy_tools.sh tools docker) + Triton Model Analyzer in its own venv,
#                            .venv-model-analyzer/ (`resnet18-kit model-analyzer --install-only`, about 600 MB).
#   scripts/setup.sh image   `make image`: demo + a Docker engine and mmdebstrap (setup_deploy_tools.sh docker).
#
# Debian packages are installed with apt-get when missing (the machine runs as root); not root? the script names
# the `sudo apt-get install ...` to run, then rerun it.
set -euo pipefail
cd "$(dirname "$0")/.."

layer=${1:-demo}
case "$layer" in
  demo)  extras=serve,export; debian=(); tools=(); model_analyzer=no ;;
  image) extras=serve,export; debian=(); tools=(docker); model_analyzer=no ;;
  check) extras=test; debian=(libb64-0d xz-utils); tools=(); model_analyzer=no ;;
  test)  extras=test; debian=(libb64-0d xz-utils); tools=(tools docker); model_analyzer=yes ;;
  *) echo "setup: unknown layer '$layer' (demo, check, test or image)" >&2; exit 2 ;;
esac

PYTHON=${PYTHON:-python3}
VENV=.venv
py_minor=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
debian+=("libpython${py_minor}")

missing=()
for pkg in "${debian[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: missing Debian packages: ${missing[*]}" >&2
    echo "setup: not root; run 'sudo apt-get install ${missing[*]}' and rerun 'scripts/setup.sh $layer'." >&2
    exit 1
  fi
  echo "setup ($layer): installing Debian packages: ${missing[*]}" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# One stamp per set of extras; the `test` extra holds serve and export, so its stamp serves the demo too.
want=$(cat constraints.txt pyproject.toml | sha256sum | cut -d' ' -f1)
stamp_of() { echo "$VENV/.requirements-${1//,/-}.sha256"; }
if [ "$(cat "$(stamp_of "$extras")" 2>/dev/null)" = "$want" ] || [ "$(cat "$(stamp_of test)" 2>/dev/null)" = "$want" ]; then
  echo "setup ($layer): $VENV is up to date with constraints.txt and pyproject.toml (extras: $extras)" >&2
else
  echo "setup ($layer): installing this package with the extras '$extras' into $VENV, pinned by constraints.txt" \
       "(torch with its CUDA libraries is about 5 GB)" >&2
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[$extras]" -c constraints.txt
  echo "$want" > "$(stamp_of "$extras")"
fi
if [ ${#tools[@]} -gt 0 ]; then
  scripts/setup_deploy_tools.sh "${tools[@]}"
fi
if [ "$model_analyzer" = yes ]; then
  echo "setup ($layer): Triton Model Analyzer in .venv-model-analyzer/ (pinned by constraints-model-analyzer.txt)" >&2
  "$VENV/bin/resnet18-kit" model-analyzer --install-only
fi

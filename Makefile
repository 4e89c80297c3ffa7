# The two commands a user needs (README.md):  make demo   and   make test;  make check is the fast tier.
# Everything runs from the venv in .venv/, created by scripts/setup.sh in layers (each target installs what it
# uses, idempotent), through its one command, .venv/bin/resnet18-kit (`resnet18-kit --help`). Set-up messages
# go to stderr, so that `make classify ARGS="--json ..." | jq .` reads JSON only.
PYTHON := .venv/bin/python
KIT := .venv/bin/resnet18-kit
ARGS ?=
# The fast tier: no tritonserver, no Docker engine, no deployment tool, nothing over 20 s (markers: pyproject.toml),
# one worker per core, each file on one worker (its module fixtures built once). ARGS="-n 0": one process.
FAST := not live and not docker and not deploy and not slow

.PHONY: setup setup-check setup-test export serve demo classify check test evaluate image clean

setup:  ## the main job's venv: tritonserver, the runtimes, export (no Docker, HAProxy or Prometheus)
	@scripts/setup.sh demo >&2

setup-check:  ## + the test tools (pytest, import-linter, perf_analyzer)
	@scripts/setup.sh check >&2

setup-test:  ## + the deployment tools and a Docker engine (compose parsers, Prometheus, HAProxy, dockerd)
	@scripts/setup.sh test >&2

export: setup  ## ResNet-18 -> model_repository (ONNX, TorchScript), only when missing
	@$(KIT) export --if-missing >&2

serve: export  ## tritonserver on 127.0.0.1:8000 (HTTP), 8001 (gRPC), 8002 (metrics); ARGS="--model-config-name ..."
	@$(KIT) serve $(ARGS)

demo: export  ## the main job: serve, classify the sample photos over HTTP and gRPC, stop
	@$(KIT) demo $(ARGS)

classify: setup  ## classify images on a running server: make classify ARGS="photo.jpg folder/"
	@$(KIT) classify $(ARGS)

check: setup-check export  ## the fast tier (about 1.5 minutes): no server, no Docker; ARGS="-k name" etc.
	@$(PYTHON) -m pytest -m "$(FAST)" -n auto --dist loadfile $(ARGS)

test: setup-test export  ## the whole suite: real tritonservers, fleets and compose stacks on free ports
	@$(PYTHON) -m pytest $(ARGS)

evaluate: export  ## accuracy (labelled folder) and agreement with FP32 of served variants: make evaluate ARGS="folder/ --variants int8"
	@$(KIT) evaluate $(ARGS)

image: export  ## the CPU images of docker-compose.yaml from PyPI's wheels (a Docker engine: yours, or `resnet18-kit docker engine start`)
	@scripts/setup.sh image >&2
	@$(KIT) docker image --with fleet,monitoring $(ARGS)

clean:  ## remove build outputs (exported models, results); keeps the venv
	rm -rf results .pytest_cache model_repository/*/1/*.onnx model_repository/*/1/*.pt \
	       model_repository/*/1/provenance.json model_repository/preprocess/warmup

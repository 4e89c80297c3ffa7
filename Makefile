# The two commands a user needs (README.md):  make demo   and   make test
# Everything runs from the venv in .venv/, created by `make setup` (scripts/setup.sh), through its one
# command, .venv/bin/resnet18-kit (`resnet18-kit --help`). Set-up messages go to stderr, so that
# `make classify ARGS="--json ..." | jq .` reads JSON only.
PYTHON := .venv/bin/python
KIT := .venv/bin/resnet18-kit
ARGS ?=

.PHONY: setup export serve demo classify test evaluate image clean

setup:  ## venv with every pinned dependency + Debian packages (idempotent)
	@scripts/setup.sh >&2

export: setup  ## ResNet-18 -> model_repository (ONNX, TorchScript), only when missing
	@$(KIT) export --if-missing >&2

serve: export  ## tritonserver on 127.0.0.1:8000 (HTTP), 8001 (gRPC), 8002 (metrics); ARGS="--model-config-name ..."
	@$(KIT) serve $(ARGS)

demo: export  ## the main job: serve, classify the sample photos over HTTP and gRPC, stop
	@$(KIT) demo $(ARGS)

classify: setup  ## classify images on a running server: make classify ARGS="photo.jpg folder/"
	@$(KIT) classify $(ARGS)

test: export  ## pytest against a real tritonserver on free ports
	@$(PYTHON) -m pytest $(ARGS)

evaluate: export  ## accuracy (labelled folder) and agreement with FP32 of served variants: make evaluate ARGS="folder/ --variants int8"
	@$(KIT) evaluate $(ARGS)

image: export  ## the CPU images of docker-compose.yaml from PyPI's wheels (a Docker engine: yours, or `resnet18-kit docker engine start`)
	@$(KIT) docker image --with fleet,monitoring $(ARGS)

clean:  ## remove build outputs (exported models, results); keeps the venv
	rm -rf results .pytest_cache model_repository/*/1/*.onnx model_repository/*/1/*.pt \
	       model_repository/*/1/provenance.json model_repository/preprocess/warmup

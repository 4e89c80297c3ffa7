# The two commands a user needs (README.md):  make demo   and   make test
# Everything runs from the venv in .venv/, created by `make setup` (scripts/setup.sh).
PYTHON := .venv/bin/python
ARGS ?=

.PHONY: setup export serve demo classify test evaluate clean

setup:  ## venv with every pinned dependency + Debian packages (idempotent)
	@scripts/setup.sh

export: setup  ## ResNet-18 -> model_repository (ONNX, TorchScript), only when missing
	@$(PYTHON) -m resnet18_kit.export --if-missing

serve: export  ## tritonserver on 127.0.0.1:8000 (HTTP), 8001 (gRPC), 8002 (metrics); ARGS="--model-config-name ..."
	@$(PYTHON) -m resnet18_kit.server $(ARGS)

demo: export  ## the main job: serve, classify the sample photos over HTTP and gRPC, stop
	@$(PYTHON) -m resnet18_kit.demo $(ARGS)

classify: setup  ## classify images on a running server: make classify ARGS="photo.jpg folder/"
	@$(PYTHON) -m resnet18_kit.client.classify $(ARGS)

test: export  ## pytest against a real tritonserver on free ports
	@$(PYTHON) -m pytest $(ARGS)

evaluate: export  ## accuracy (labelled folder) and agreement with FP32 of served variants: make evaluate ARGS="folder/ --variants int8"
	@$(PYTHON) -m resnet18_kit.bench.evaluate $(ARGS)

clean:  ## remove build outputs (exported models, results); keeps the venv
	rm -rf results .pytest_cache model_repository/*/1/*.onnx model_repository/*/1/*.pt \
	       model_repository/*/1/provenance.json model_repository/preprocess/warmup

"""Triton Python-backend model for an exported ResNet-18 (FP32 [N,3,224,224] -> logits FP32 [N,1000]).

Shared by `resnet18_onnx` (model.onnx or model.int8.onnx, run by ONNX Runtime or OpenVINO) and
`resnet18_torchscript` (model.pt, run by TorchScript): `resnet18_torchscript/1/model.py` is a link to this
file. The config's parameters name the file, the runtime and its threads (runtimes.py, beside this file).

execute() stacks the inputs of every request the dynamic batcher handed over into one batch, runs the
network once, and splits the logits back per request. If the stacked run fails, each request is run
alone, so only the request that fails gets an error.
"""
import json
import os
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import runtimes  # noqa: E402  (beside this file: how each runtime is loaded and configured)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.input_name = config["input"][0]["name"]
        output = config["output"][0]
        self.output_name = output["name"]
        self.output_dtype = pb_utils.triton_string_to_numpy(output["data_type"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        spec = runtimes.RuntimeSpec.from_parameters(params, Path(args["model_repository"]) / args["model_version"])
        self.run = runtimes.load(spec)

    def execute(self, requests):
        inputs = [pb_utils.get_input_tensor_by_name(r, self.input_name).as_numpy() for r in requests]
        try:
            logits = self.run(np.concatenate(inputs))
            per_request = np.split(logits, np.cumsum([len(x) for x in inputs])[:-1])
        except Exception:
            return [self._run_alone(batch) for batch in inputs]
        return [self._response(out) for out in per_request]

    def _run_alone(self, batch):
        try:
            return self._response(self.run(batch))
        except Exception as exc:
            return pb_utils.InferenceResponse(
                error=pb_utils.TritonError(f"inference failed: {exc}", pb_utils.TritonError.INTERNAL))

    def _response(self, logits):
        tensor = pb_utils.Tensor(self.output_name, np.ascontiguousarray(logits, dtype=self.output_dtype))
        return pb_utils.InferenceResponse(output_tensors=[tensor])

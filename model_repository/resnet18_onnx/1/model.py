"""Triton Python-backend model for an exported ResNet-18: UINT8 pixels [N,3,224,224] (normalized in the
exported graph) -> logits and probabilities
(their softmax), both FP32 [N,1000]; the config lists which of the two it serves.

Shared by `resnet18_onnx` (model.onnx or model.int8.onnx, run by ONNX Runtime or OpenVINO) and
`resnet18_torchscript` (model.pt, run by TorchScript): `resnet18_torchscript/1/model.py` is a link to this
file. The config's parameters name the file, the runtime and its threads (runtimes.py, beside this file);
an instance of kind KIND_GPU runs the network on its GPU (torchscript only:
resnet18_torchscript/configs/gpu_python.pbtxt).

execute() stacks the inputs of every request the dynamic batcher handed over into one batch, runs the
network once, and splits the outputs back per request. If the stacked run fails, each request is run
alone, so only the request that fails gets an error. A request whose client has gone (cancellation.py
beside this file: Triton's own flag, or the mark of serve's gRPC guard) is answered CANCELLED and left out
of the batch.
"""
import json
import os
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import runtimes  # noqa: E402  (beside this file: how each runtime is loaded and configured)
from allocator import keep_large_blocks  # noqa: E402
from cancellation import Cancellation  # noqa: E402


def cancelled():
    """The answer to a request whose client has gone: Triton's standard CANCELLED status, nothing computed."""
    return pb_utils.InferenceResponse(error=pb_utils.TritonError("request cancelled", pb_utils.TritonError.CANCELLED))


class TritonPythonModel:
    def initialize(self, args):
        keep_large_blocks()  # the batch's input copies and outputs reuse freed memory (allocator.py)
        config = json.loads(args["model_config"])
        self.input_name = config["input"][0]["name"]
        #: (name, position in the runtime's outputs, numpy dtype) of each output the config lists.
        self.outputs = [(output["name"], runtimes.OUTPUT_NAMES.index(output["name"]),
                         pb_utils.triton_string_to_numpy(output["data_type"])) for output in config["output"]]
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        spec = runtimes.RuntimeSpec.from_parameters(params, Path(args["model_repository"]) / args["model_version"],
                                                    device=runtimes.instance_device(args))
        self.run = runtimes.load(spec)
        self.cancellation = Cancellation.from_environment()

    def execute(self, requests):
        gone = [self.cancellation.gone(request) for request in requests]
        live = [request for request, g in zip(requests, gone) if not g]
        answers = iter(self._batch(live) if live else ())
        return [cancelled() if g else next(answers) for g in gone]

    def _batch(self, requests):
        inputs = [pb_utils.get_input_tensor_by_name(r, self.input_name).as_numpy() for r in requests]
        try:
            ends = np.cumsum([len(x) for x in inputs])  # where each request's rows end in the batch
            staging = getattr(self.run, "staging", None)  # a GPU runner's pinned input buffer (runtimes.py)
            batch = (np.concatenate(inputs, out=staging(int(ends[-1]), inputs[0])) if staging
                     else np.concatenate(inputs))
            outputs = self.run(batch)
            per_request = zip(*(np.split(output, ends[:-1]) for output in outputs))
        except Exception:
            return [self._run_alone(batch) for batch in inputs]
        return [self._response(out) for out in per_request]

    def _run_alone(self, batch):
        try:
            return self._response(self.run(batch))
        except Exception as exc:
            return pb_utils.InferenceResponse(
                error=pb_utils.TritonError(f"inference failed: {exc}", pb_utils.TritonError.INTERNAL))

    def _response(self, outputs):
        tensors = [pb_utils.Tensor(name, np.ascontiguousarray(outputs[position], dtype=dtype))
                   for name, position, dtype in self.outputs]
        return pb_utils.InferenceResponse(output_tensors=tensors)

"""Test stub with ResNet-18's signature: logits[i] = the first 1000 input values of batch element i (as FP32),
after sleeping `execute_delay_ms` per execution (a stand-in for a slow network)."""
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        self.delay_s = float(params["execute_delay_ms"]["string_value"]) / 1000.0

    def execute(self, requests):
        time.sleep(self.delay_s)
        responses = []
        for request in requests:
            pixels = pb_utils.get_input_tensor_by_name(request, "input").as_numpy()
            logits = np.ascontiguousarray(pixels.reshape(len(pixels), -1)[:, :1000], dtype=np.float32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("logits", logits)]))
        return responses

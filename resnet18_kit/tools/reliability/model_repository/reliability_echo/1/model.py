"""Test model for the reliability tests: y = x (FP32 [N, 4]) after sleeping `execute_delay_ms` per
execution, so requests pile up in the queue at a known rate while costing no CPU."""
import json
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.input_name = config["input"][0]["name"]
        self.output_name = config["output"][0]["name"]
        self.delay_s = float(config["parameters"]["execute_delay_ms"]["string_value"]) / 1000.0

    def execute(self, requests):
        time.sleep(self.delay_s)
        return [pb_utils.InferenceResponse(
                    [pb_utils.Tensor(self.output_name, pb_utils.get_input_tensor_by_name(r, self.input_name).as_numpy())])
                for r in requests]

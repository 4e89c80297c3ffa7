"""identity: each request's INPUT returned as OUTPUT (no copy on the Python side beyond Triton's own)."""
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", pb_utils.get_input_tensor_by_name(
            request, "INPUT").as_numpy())]) for request in requests]

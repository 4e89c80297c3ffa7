"""Triton Python-backend model `preprocess`: encoded image bytes -> UINT8 [3, 224, 224] pixels, the networks' input.

Each request carries a batch of images (input `image`, BYTES [N, 1]); the dynamic batcher hands several
requests to one execute() call. Images are decoded one by one (they differ in size), each written straight
into its row of the request's output batch (UINT8 [N, 3, 224, 224]), so a corrupt image
fails only its own request, with INVALID_ARG (HTTP 400 / gRPC INVALID_ARGUMENT) and a message naming
the problem; the other requests of the batch get their tensors.

Cancellation: a request whose client has gone (cancellation.py beside this file: Triton's own flag, or the
mark of serve's gRPC guard) is answered CANCELLED before its images are decoded (microseconds, against
milliseconds per image). An HTTP client that disconnects does not cancel its request.
"""
import json
import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from allocator import keep_large_blocks  # noqa: E402
from cancellation import Cancellation  # noqa: E402
from image_transform import ImageDecodeError, ImageLimits, preprocess  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        keep_large_blocks()  # a request's input copies and decoded image reuse freed memory (allocator.py)
        config = json.loads(args["model_config"])
        self.input_name = config["input"][0]["name"]
        output = config["output"][0]
        self.output_name = output["name"]
        self.output_dtype = pb_utils.triton_string_to_numpy(output["data_type"])
        self.output_shape = tuple(int(d) for d in output["dims"])  # [3, 224, 224]
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        self.limits = ImageLimits(
            max_image_bytes=int(params["max_image_bytes"]),
            max_image_pixels=int(params["max_image_pixels"]),
            max_aspect_ratio=float(params["max_aspect_ratio"]),
        )
        self.cancellation = Cancellation.from_environment()

    def execute(self, requests):
        return [self._respond(request) for request in requests]

    def _respond(self, request):
        if self.cancellation.gone(request):
            return pb_utils.InferenceResponse(
                error=pb_utils.TritonError("request cancelled", pb_utils.TritonError.CANCELLED))
        images = pb_utils.get_input_tensor_by_name(request, self.input_name).as_numpy().reshape(-1)
        pixels = np.empty((len(images), *self.output_shape), self.output_dtype)
        try:
            for item, row in zip(images, pixels):  # each image decoded straight into its row of the batch
                preprocess(item, self.limits, out=row)
        except ImageDecodeError as exc:
            return pb_utils.InferenceResponse(
                error=pb_utils.TritonError(f"input '{self.input_name}': {exc}", pb_utils.TritonError.INVALID_ARG))
        except Exception as exc:  # a bug, not bad input: fail this request only, keep serving
            return pb_utils.InferenceResponse(
                error=pb_utils.TritonError(f"preprocess failed: {exc!r}", pb_utils.TritonError.INTERNAL))
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(self.output_name, pixels)])

"""Run Triton Inference Server 2.51 (the `tritonserver` bundled in nvidia-pytriton) on this repository."""

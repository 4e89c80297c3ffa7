"""Export torchvision ResNet-18 into the Triton model repository (ONNX, TorchScript, labels)."""

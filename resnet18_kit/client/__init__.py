"""Python clients for the ResNet-18 model repository served by Triton (HTTP and gRPC)."""

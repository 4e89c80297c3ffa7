"""Containers: the CPU images of docker-compose.yaml (image), the Docker engine they run on (engine), and
the command `resnet18-kit docker` (__main__)."""

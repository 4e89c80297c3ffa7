"""Serve ResNet-18 on NVIDIA Triton Inference Server with dynamic batching: export, model repository,
clients, the embedded server, and the tools that measure and plan it.

Layers, each importing only those below it (checked by import-linter, see pyproject.toml):
  contract    names, shapes, ports, protocols, variants and their files, folders
  observe     what a running server says: metrics, statistics extension, model configs, machine
  load        load generation: perf_analyzer runs, photo inputs
  bench, reliability, planner    measurements and planning built on the above
client, server and export sit beside them and import the contract.
"""

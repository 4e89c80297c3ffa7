"""Capacity planner for Triton's dynamic batcher: size the batcher and the fleet for a load and an SLO.

* `profile`:   the measured execution time per batch size (per instance count) and the fixed per-request
               overhead, stored as a small JSON (a GPU machine's profile can be planned on a laptop);
* `batcher`:   the typed batcher config and Triton 2.51's batch-formation rule (`form_batch`, after
               `DynamicBatchScheduler::GetDynamicBatch` in triton-inference-server/core r24.10);
* `arrivals`:  Poisson, bursty (two-state MMPP) and replayed-trace arrivals, split over replicas by a
               round-robin or random load balancer;
* `simulator`: the discrete-event simulation of one replica: queue policy, batcher, N instances;
* `search`:    the planner: cheapest config (fewest devices) meeting a latency percentile budget;
* `pbtxt`:     write the chosen config with tritonclient's model_config_pb2 (configs are read through
               observe.model_config; `batcher.batcher_from_config` turns a ModelConfigView into a BatcherConfig);
* `measure`, `validate`: the profile and the validation runs against the embedded tritonserver;
* `validate_analysis`: the validation's trace analysis, predictions and tables (no server).

`resnet18-kit plan --help` lists the commands; docs/capacity.md has the figures and what is modelled.
"""

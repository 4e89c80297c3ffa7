"""What a running Triton server and this machine say: metrics, statistics, model configs, /proc."""

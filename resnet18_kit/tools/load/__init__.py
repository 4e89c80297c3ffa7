"""Load generation: perf_analyzer command, runs and export parsing; photo inputs for it."""

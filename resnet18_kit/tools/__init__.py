"""The kit's tools, apart from the product: they measure, stress and size the server; nothing of the
product imports them (import-linter's contracts in pyproject.toml).

- bench: perf_analyzer sweeps, client pipelines, accuracy (`evaluate`), Model Analyzer, the docs' figures
- reliability: overload, faults, shutdown and swap scenarios, every request accounted for
- planner: the capacity planner (`plan profile | plan | validate`)
- load: what the three share: perf_analyzer runs, outcome counting, photos, results folders
"""

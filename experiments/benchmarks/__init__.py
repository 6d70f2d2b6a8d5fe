"""Speed and memory measurements: ``python -m experiments.benchmarks.bench_<subject>``."""

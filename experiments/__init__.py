"""Benchmarks and studies of ragen_jax, run from the repository root as modules:
``python -m experiments.benchmarks.<script>`` (speed and memory) or
``python -m experiments.studies.<script>`` (learning and behaviour). Each script's docstring
gives its command; its results go to ``experiments/results/``, indexed by ``docs/results.md``.
"""

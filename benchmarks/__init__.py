"""The benchmark CLI: ``python -m flashjax.benchmarks --help``."""

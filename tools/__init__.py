"""Experiment and machine scripts of the flashjax checkout (config sweeps, probes,
profilers, the offline GPU wrapper). Not part of the installed package: run them
from the repository root as ``python -m tools.<name>`` with flashjax importable."""

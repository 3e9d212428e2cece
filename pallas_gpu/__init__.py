"""Pallas GPU kernels: ``mosaic`` (Mosaic-GPU, Hopper) and ``pallas_triton``
(Pallas lowered through Triton). Submodules are imported when used."""

NAME = "pallas_gpu"

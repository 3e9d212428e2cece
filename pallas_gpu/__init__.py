"""Pallas GPU kernels: ``pallas_triton`` (Pallas lowered through Triton: the whole
contract, forward and backward) and ``mosaic`` (Mosaic-GPU for Hopper: a
warp-specialised forward, with the Pallas-Triton backward). Submodules are
imported when used."""

NAME = "pallas_gpu"

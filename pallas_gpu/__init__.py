"""Pallas GPU kernels: ``pallas_triton`` (Pallas lowered through Triton: the whole
contract, forward and backward) and ``mosaic`` (Mosaic-GPU for Hopper: a
warp-specialised forward and its own dQ and dK/dV backward kernels up to D = 128;
wider heads, or ``MosaicConfig(backward_kernel="triton")``, take the Pallas-Triton
backward). Submodules are imported when used."""

NAME = "pallas_gpu"

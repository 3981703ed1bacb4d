"""Triton kernels behind `pddcore.kernels` (installed as `pddcore.triton_kernels`)."""

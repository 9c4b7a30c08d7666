"""Triton kernels, one concern a module, each with a plain reference beside it."""

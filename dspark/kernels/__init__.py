"""Triton kernels; each module holds kernel(s), launcher and the torch reference they must match."""

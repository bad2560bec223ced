"""Triton kernels for the kvserve runtime, each with a pure-torch reference twin."""

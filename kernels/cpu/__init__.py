"""Native CPU kernels (C, AVX2 + FMA), compiled at first use; see native.py."""

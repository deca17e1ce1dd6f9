"""Decode hot-path kernels. Each ``<op>.py`` holds a plain-PyTorch reference (``*_ref``,
the CPU path and the tests' oracle) and, where CUDA is present, a Triton kernel with a
launcher that checks shapes, dtypes, strides and devices. :mod:`kernels.dispatch` picks one.

Shape symbols: B batch, Hq query heads, Hkv KV heads, G = Hq/Hkv, D head dim, S page size,
P pages per request (``P_max`` the padded width), W = ceil(P/32) bitmask words,
N record slots, K selected pages (padded width ``K_max``), C slots per slab.
"""

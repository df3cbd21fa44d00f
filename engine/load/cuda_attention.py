"""Which attention kernels an engine uses on MLX's CUDA backend.

MLX sends attention with more than one query token to cuDNN, and builds one cuDNN graph per
exact shape of queries, keys and mask (`mlx/backend/cuda/scaled_dot_product_attention.cpp`,
an LRU of 256). A served engine meets a new shape at almost every such call: each prefill of
a prompt of a length not seen before, and each speculative verify pass (its key length is the
row's whole context). Each new shape pays for a graph build, many times the pass itself, while
a shape seen before runs about as fast either way (`benchmarks/cuda_sdpa_shapes.py`; figures:
benchmarks/RESULTS.md, "cuDNN attention on CUDA").

A decode step is not affected: a batch's cache always passes an array mask, which MLX's cuDNN
decoding path does not take. So engines turn cuDNN's fused attention off unless the user set
`MLX_CUDA_USE_CUDNN_SDPA` themselves: the fused kernel's gain, small at best, on long prompts
whose length repeats does not pay for a graph build on every prompt whose length does not.
MLX reads the variable once, at its first attention on the GPU, so this must run before the
model's first forward pass. A sharded group's ranks get rank 0's value (`kinds/group/leader.py`).
Other backends (Metal, CPU) do not read it.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("mlxd.engine")

ENV = "MLX_CUDA_USE_CUDNN_SDPA"


def apply() -> str:
    """Default the variable to off for this process; return the value in force."""
    value = os.environ.setdefault(ENV, "0")
    try:
        import mlx.core as mx
        on_cuda = bool(mx.cuda.is_available())
    except (ImportError, AttributeError):
        on_cuda = False
    if on_cuda:
        log.info("CUDA attention: cuDNN's fused kernel %s (%s=%s)",
                 "off" if value == "0" else "on", ENV, value)
    return value

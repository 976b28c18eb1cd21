"""A tensor's bytes, to hash at memory speed (extra `torch`).

`bytes(tensor.untyped_storage())` walks the storage one byte at a time in Python: minutes
for a few million parameters. `tensor_bytes` hands hashlib the same bytes as a buffer.
"""

from __future__ import annotations

import torch


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's elements as raw bytes, in row-major order: the bytes of a contiguous
    CPU copy's own storage (`clone().untyped_storage()`). A view of the tensor's memory
    when it is a contiguous CPU tensor; else one copy, to the CPU in row-major order."""
    # One copy at most: `to` returns the tensor itself when it is already in that form.
    data = tensor.detach().to("cpu", memory_format=torch.contiguous_format)
    # Flat first (a 0-d tensor cannot be viewed as another dtype), then as bytes (NumPy
    # knows no bfloat16); the view holds NumPy's array, which holds the tensor's memory.
    return data.reshape(-1).view(torch.uint8).numpy().data

"""Weights are hashed from a buffer, at memory speed, to the digest the byte-by-byte copy
of each tensor's storage gave: runs hashed before and after compare equal."""

from __future__ import annotations

import hashlib

import pytest

pytest.importorskip("torch")

import torch

from training.tensor_bytes import tensor_bytes
from training.torch_workload.parallel import weights_sha256


def reference_bytes(tensor: torch.Tensor) -> bytes:
    """What the workloads hashed before: a contiguous CPU clone's own storage, read a byte
    at a time (slow: small tensors only)."""
    return bytes(tensor.detach().cpu().contiguous().clone().untyped_storage())


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 5, 4, generator=g)
    return {
        "float32": base,
        "float64": base.double(),
        "float16": base.half(),
        "bfloat16": base.bfloat16(),
        "int64": (base * 100).long(),
        "int8": (base * 10).to(torch.int8),
        "uint8": (base * 10).abs().to(torch.uint8),
        "bool": base > 0,
        "complex64": torch.complex(base, -base),
        "0-d": torch.tensor(2.5),
        "0-d bfloat16": torch.tensor(-1.5, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 3),
        "transposed": base[:, :, 0].t(),
        "offset slice": base.reshape(-1)[7:50],
        "strided bfloat16": base.bfloat16()[::2, 1:, ::3],
        "channels_last": torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
        "expanded": torch.randn(3, 1, generator=g).expand(3, 4),
        "parameter": torch.nn.Parameter(base.clone()),
    }


@pytest.mark.parametrize("name", list(_tensors()))
def test_a_tensors_bytes_are_its_storages_in_row_major_order(name: str) -> None:
    tensor = _tensors()[name]
    assert bytes(tensor_bytes(tensor)) == reference_bytes(tensor)


def test_known_bytes_and_a_contiguous_cpu_tensor_is_not_copied() -> None:
    bf16 = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)
    assert bytes(tensor_bytes(bf16)) == b"\x80\x3f\x00\xc0"  # 0x3f80, 0xc000, little-endian
    tensor = torch.zeros(4, dtype=torch.int32)
    view = tensor_bytes(tensor)
    tensor[1] = 7
    assert bytes(view[4:8]) == b"\x07\x00\x00\x00"


def test_the_workloads_weights_hash_is_the_one_it_was() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4))
    model[1].to(torch.bfloat16)
    model.register_buffer("counts", torch.arange(5).reshape(5, 1).expand(5, 2))
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(reference_bytes(tensor))
    assert weights_sha256(model) == digest.hexdigest()

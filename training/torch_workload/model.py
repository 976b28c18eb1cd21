"""A decoder-only transformer language model and its deterministic synthetic data."""

from __future__ import annotations

import torch
from torch import nn


class DecoderLM(nn.Module):
    def __init__(
        self, vocab_size: int, d_model: int, n_layers: int, n_heads: int, seq_len: int
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.position = nn.Parameter(torch.zeros(seq_len, d_model))
        layer = nn.TransformerEncoderLayer(
            d_model, n_heads, dim_feedforward=4 * d_model, dropout=0.1, batch_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.causal: torch.Tensor
        self.register_buffer(
            "causal", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        x = self.embed(tokens) + self.position[:n]
        x = self.blocks(x, mask=self.causal[:n, :n], is_causal=True)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


def batch(
    seed: int, step: int, rank: int, *, batch_size: int, seq_len: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of one rank at one step: a noisy arithmetic sequence per row, so
    there is something to learn; the same for the same (seed, step, rank), always."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)
    start = torch.randint(0, vocab_size, (batch_size, 1), generator=g)
    stride = torch.randint(1, 8, (batch_size, 1), generator=g)
    tokens = (start + stride * torch.arange(seq_len + 1)) % vocab_size
    noise = torch.rand(batch_size, seq_len + 1, generator=g) < 0.05
    tokens = torch.where(noise, torch.randint(0, vocab_size, tokens.shape, generator=g), tokens)
    return tokens[:, :-1], tokens[:, 1:]

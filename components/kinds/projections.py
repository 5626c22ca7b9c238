"""Attention projections under ``nn.MultiheadAttention``'s parameter names.

A custom path that names its tensors like its native twin shares one state dict with
it: one seed or one safetensors file gives both paths the same weights, and their
outputs can be compared directly.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.functional import linear

# B batch, H heads, S seq, D head dim, E model width, T packed tokens


class MultiheadProjections(nn.Module):
    """Hold the input and output projections of one multi-head attention.

    As in ``nn.MultiheadAttention``, q, k and v share one packed ``in_proj_weight``
    when the keys have the query's width, and have ``q_proj_weight``,
    ``k_proj_weight``, ``v_proj_weight`` otherwise; ``in_proj_bias`` and
    ``out_proj`` exist either way. Rows of the packed weight are q, then k, then v.
    Values are zeros until the loader fills them (seed or file).

    Args:
        dim: the query and output width E.
        heads: the attention heads H; must divide ``dim``.
        kdim: the width of the key/value input; None means ``dim``.
    """

    def __init__(self, dim: int, heads: int, kdim: int | None = None) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"{heads} heads do not divide width {dim}; pick a divisor")
        kdim = dim if kdim is None else kdim
        self.heads = heads
        self.head_dim = dim // heads
        self.is_packed = kdim == dim
        if self.is_packed:
            self.in_proj_weight = nn.Parameter(torch.zeros(3 * dim, dim))
        else:
            self.q_proj_weight = nn.Parameter(torch.zeros(dim, dim))
            self.k_proj_weight = nn.Parameter(torch.zeros(dim, kdim))
            self.v_proj_weight = nn.Parameter(torch.zeros(dim, kdim))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * dim))
        self.out_proj = nn.Linear(dim, dim)

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.is_packed:
            wq, wk, wv = self.in_proj_weight.chunk(3)
            return wq, wk, wv
        return self.q_proj_weight, self.k_proj_weight, self.v_proj_weight

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(*x.shape[:-1], self.heads, self.head_dim)  # (..., H, D)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project ``x`` ``(..., E)`` to q, k, v ``(..., H, D)`` for self-attention."""
        if self.is_packed:
            # one matmul for all three, as MultiheadAttention does
            q, k, v = linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
            return self._split(q), self._split(k), self._split(v)
        return self.project_q(x), *self.project_kv(x)

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        """Project queries ``(..., E)`` to ``(..., H, D)``."""
        wq = self._weights()[0]
        bq = self.in_proj_bias.chunk(3)[0]
        return self._split(linear(x, wq, bq))

    def project_kv(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Project keys and values ``(..., kdim)`` to two ``(..., H, D)`` tensors."""
        _, wk, wv = self._weights()
        _, bk, bv = self.in_proj_bias.chunk(3)
        return self._split(linear(context, wk, bk)), self._split(linear(context, wv, bv))

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        """Merge heads ``(..., H, D)`` and apply the output projection: ``(..., E)``."""
        out: torch.Tensor = self.out_proj(o.flatten(-2))
        return out

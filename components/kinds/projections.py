"""Attention projections under ``nn.MultiheadAttention``'s parameter names.

A custom path that names its tensors like its native twin shares one state dict with
it: one seed or one safetensors file gives both paths the same weights, and their
outputs can be compared directly.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.functional import linear

__all__ = ["MultiheadProjections"]

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

    q_proj: nn.Linear  # these three exist after split_for_tensor_parallel
    k_proj: nn.Linear
    v_proj: nn.Linear

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
        self.is_split = False

    def split_for_tensor_parallel(self) -> None:
        """Hold q, k and v as three ``nn.Linear`` (``q_proj``, ``k_proj``, ``v_proj``).

        Tensor parallel shards each by output rows (heads) with ``ColwiseParallel``, which
        takes modules, not the packed parameter whose rows mix q, k and v. The values stay.
        """
        wq, wk, wv = (w.detach() for w in self._weights())
        bq, bk, bv = self.in_proj_bias.detach().chunk(3)
        for name, weight, bias in (("q_proj", wq, bq), ("k_proj", wk, bk), ("v_proj", wv, bv)):
            proj = nn.Linear(weight.shape[1], weight.shape[0], device=weight.device)
            proj.weight = nn.Parameter(weight.clone(), requires_grad=False)
            proj.bias = nn.Parameter(bias.clone(), requires_grad=False)
            setattr(self, name, proj)
        for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight"):
            if hasattr(self, name):
                delattr(self, name)
        del self.in_proj_bias
        self.is_split = True

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.is_packed:
            wq, wk, wv = self.in_proj_weight.chunk(3)
            return wq, wk, wv
        return self.q_proj_weight, self.k_proj_weight, self.v_proj_weight

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        # the heads are counted from the width: tensor parallel leaves H / tp on a rank
        return x.reshape(*x.shape[:-1], -1, self.head_dim)  # (..., H, D)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project ``x`` ``(..., E)`` to q, k, v ``(..., H, D)`` for self-attention."""
        if self.is_packed and not self.is_split:
            # one matmul for all three, as MultiheadAttention does
            q, k, v = linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
            return self._split(q), self._split(k), self._split(v)
        return self.project_q(x), *self.project_kv(x)

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        """Project queries ``(..., E)`` to ``(..., H, D)``."""
        if self.is_split:
            return self._split(self.q_proj(x))
        wq = self._weights()[0]
        bq = self.in_proj_bias.chunk(3)[0]
        return self._split(linear(x, wq, bq))

    def project_kv(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Project keys and values ``(..., kdim)`` to two ``(..., H, D)`` tensors."""
        if self.is_split:
            return self._split(self.k_proj(context)), self._split(self.v_proj(context))
        _, wk, wv = self._weights()
        _, bk, bv = self.in_proj_bias.chunk(3)
        return self._split(linear(context, wk, bk)), self._split(linear(context, wv, bv))

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        """Merge heads ``(..., H, D)`` and apply the output projection: ``(..., E)``."""
        out: torch.Tensor = self.out_proj(o.flatten(-2))
        return out

"""A DiT block's attention: diffusers' projection names around one ``attention.Attention``.

Self-attention (and Flux's and SD3's joint attention, which is self-attention over each
request's text and image tokens together) runs on the packed joint rows: one varlen
call when the site declares packed sequences, one dense call per request otherwise, and
through ``attention.distributed`` (Ulysses, ring, K/V gather) under sequence parallel.
Cross-attention (PixArt) attends each request's image rows to its own text.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from attention.distributed import packed_sequence_attention
from components.mesh import SequenceGroups
from components.models.dit.layout import JointLayout, Rows
from components.sites import AttentionSite, SiteLayer

__all__ = ["DitAttention"]

# B requests, H heads, D head dim, E width, n rows, T joint rows, L_i text tokens


class DitAttention(nn.Module):
    """Hold one attention's projections (diffusers' names) and its site's kernel.

    Args:
        dim: the query (and output) width E.
        heads: attention heads H.
        head_dim: each head's width D.
        site: the declared site the kernel is built for (at load, ``build_layers``).
        kdim: the width keys and values are projected from (cross-attention); None is E.
        out: it has an output projection ``to_out.0`` (Flux's single blocks have none).
        context: it projects text rows too (``add_q_proj``, ``add_k_proj``, ``add_v_proj``).
        context_out: it projects text rows out (``to_add_out``).
        qk_norm: queries and keys are RMS-normalised per head (``norm_q``, ``norm_k``,
            and ``norm_added_q``, ``norm_added_k`` with ``context``).
        eps: the RMS norms' epsilon.
        bias: the image rows' projections (``to_q``, ``to_k``, ``to_v``, ``to_out.0``) have
            biases (Z-Image's have none).
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        head_dim: int,
        site: AttentionSite,
        *,
        kdim: int | None = None,
        out: bool = True,
        context: bool = False,
        context_out: bool = False,
        qk_norm: bool = False,
        eps: float = 1e-6,
        bias: bool = True,
    ) -> None:
        super().__init__()
        inner = heads * head_dim
        self.head_dim = head_dim
        self.to_q = nn.Linear(dim, inner, bias=bias)
        self.to_k = nn.Linear(kdim or dim, inner, bias=bias)
        self.to_v = nn.Linear(kdim or dim, inner, bias=bias)
        self.norm_q = nn.RMSNorm(head_dim, eps=eps) if qk_norm else None
        self.norm_k = nn.RMSNorm(head_dim, eps=eps) if qk_norm else None
        self.to_out = nn.ModuleList([nn.Linear(inner, dim, bias=bias)]) if out else None
        if context:
            self.add_q_proj = nn.Linear(dim, inner)
            self.add_k_proj = nn.Linear(dim, inner)
            self.add_v_proj = nn.Linear(dim, inner)
            self.norm_added_q = nn.RMSNorm(head_dim, eps=eps) if qk_norm else None
            self.norm_added_k = nn.RMSNorm(head_dim, eps=eps) if qk_norm else None
        self.to_add_out = nn.Linear(inner, dim) if context_out else None
        self.kernel = SiteLayer(site)
        self.is_varlen = site.requirements.packed_varlen
        self.sequence: SequenceGroups | None = None

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        # the heads are counted from the width: tensor parallel leaves H / tp on a rank;
        # never as -1, which a shard holding no rows of this stream cannot resolve
        return x.view(*x.shape[:-1], x.shape[-1] // self.head_dim, self.head_dim)  # (n, H, D)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project image rows ``(n, E)`` to q, k, v ``(n, H, D)`` (q and k normalised)."""
        q, k, v = self._heads(self.to_q(x)), self._heads(self.to_k(x)), self._heads(self.to_v(x))
        if self.norm_q is not None and self.norm_k is not None:
            q, k = self.norm_q(q), self.norm_k(k)
        return q, k, v

    def project_context(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project text rows ``(n, E)`` to q, k, v ``(n, H, D)`` with the added projections."""
        q = self._heads(self.add_q_proj(x))
        k = self._heads(self.add_k_proj(x))
        v = self._heads(self.add_v_proj(x))
        if self.norm_added_q is not None and self.norm_added_k is not None:
            q, k = self.norm_added_q(q), self.norm_added_k(k)
        return q, k, v

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """Project attended image rows ``(n, H * D)`` out: ``(n, E)``."""
        assert self.to_out is not None  # built with out=True
        out: torch.Tensor = self.to_out[0](o)
        return out

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: JointLayout
    ) -> torch.Tensor:
        """Attend each request's joint rows to its own: ``(T, H, D)`` to ``(T, H * D)``."""
        if self.sequence is not None:
            o = packed_sequence_attention(
                q,
                k,
                v,
                self.kernel.layer,
                layout.packing.bounds,
                ulysses=self.sequence.ulysses,
                ring=self.sequence.ring,
                kv_gather=self.sequence.kv_gather,
                varlen=self.is_varlen,
            )
        elif len(layout.packing.counts) == 1:
            # one request: the varlen call would be this dense call, plus a copy of its output
            o = self._dense(q, k, v)
        elif self.is_varlen:
            cu = layout.packing.cu_seqlens
            width = layout.packing.max_seqlen
            o = self.kernel.layer.forward_varlen(q, k, v, cu, cu, width, width)
        else:
            o = torch.cat(
                [self._dense(q[a:b], k[a:b], v[a:b]) for _, a, b in layout.joint_rows.spans()]
            )
        return o.flatten(-2)

    def cross(self, h: torch.Tensor, rows: Rows, context: Sequence[torch.Tensor]) -> torch.Tensor:
        """Attend each request's rows of ``h`` ``(n, E)`` to its text ``(L_i, kdim)``: ``(n, E)``.

        Padding rows (sequence parallel) attend to nothing and get zeros.
        """
        outs = []
        for i, a, b in rows.spans():
            q = self._heads(self.to_q(h[a:b]))
            k, v = self._heads(self.to_k(context[i])), self._heads(self.to_v(context[i]))
            outs.append(self._dense(q, k, v).flatten(-2))
        out = self.output(torch.cat(outs)) if outs else h.new_zeros(0, h.shape[-1])
        if rows.padding:
            out = torch.cat([out, out.new_zeros(rows.padding, out.shape[-1])])
        return out

    def _dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attend one request's ``(S, H, D)`` rows densely: ``(S, H, D)``."""
        o: torch.Tensor = self.kernel.layer(*(t.transpose(0, 1)[None] for t in (q, k, v)))
        return o[0].transpose(0, 1)  # from (1, H, S, D)

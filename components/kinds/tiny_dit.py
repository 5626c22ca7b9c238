"""``tiny_dit``: a DiT, latent tokens + timestep + text embeddings to a prediction.

Each block modulates its inputs by the timestep (adaLN), attends its tokens to each
other (site ``self``) and to the request's text (site ``cross``), then runs an MLP.
With ``packed_sequences`` (the default) the custom path packs requests of different
token counts into one sequence and self-attention runs ``forward_varlen``: no compute
is spent on padding. Otherwise, and on the native path (``nn.MultiheadAttention``),
requests run one at a time, dense, without a mask.
"""

from __future__ import annotations

import math
from typing import Annotated, ClassVar, NamedTuple

import msgspec
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.functional import pad, silu

from attention import AttentionRequirements, AttentionRole
from attention.distributed import packed_sequence_attention
from attention.distributed.traffic import record
from components.batch import Batch, Port, device_of
from components.cache import StepCache, run_cached, step_rows
from components.cache.state import any_cached, release_caches, start_rows
from components.kinds import tensors
from components.kinds.projections import MultiheadProjections
from components.kinds.tiny_text_encoder import DEFAULT_DIM
from components.loader import ComponentLoader, SeededOptions
from components.mesh import ComponentParallel, SequenceGroups
from components.models.dit.streams import Streams, StreamStack, owned
from components.models.packing import Packing, gather_rows
from components.sites import NO_REQUIREMENTS, AttentionSite
from components.tensor_parallel import split_layers
from components.weights import DeclaredTensors

__all__ = ["TinyDitLoader"]

# B requests, H heads, S seq, D head dim, E model width, C latent channels,
# N_i / L_i tokens / text tokens of request i, T packed tokens (sum of N_i)


class TinyDitOptions(SeededOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of ``tiny_dit``.

    Attributes:
        in_channels: channels C of each latent token (in and out).
        dim: the model width E; even (sinusoidal embeddings) and a multiple of ``heads``.
        heads: attention heads per layer, self and cross.
        layers: DiT blocks.
        ffn_dim: the hidden width of each block's MLP.
        context_dim: the width of the text embeddings (the text encoder's ``dim``).
        packed_sequences: pack requests into one sequence for self-attention (needs a
            packed-varlen backend); false runs one request at a time with no mask.
        guidance_scale: the classifier-free guidance scale of a request that sets none
            (1: off).

    Raises:
        ValueError: ``heads`` does not divide ``dim`` (a ``msgspec.ValidationError`` when
            the options are decoded).
    """

    in_channels: Annotated[int, msgspec.Meta(ge=1)] = 4
    dim: Annotated[int, msgspec.Meta(ge=2, multiple_of=2)] = 32
    heads: Annotated[int, msgspec.Meta(ge=1)] = 4
    layers: Annotated[int, msgspec.Meta(ge=1)] = 2
    ffn_dim: Annotated[int, msgspec.Meta(ge=1)] = 64
    context_dim: Annotated[int, msgspec.Meta(ge=1)] = DEFAULT_DIM
    packed_sequences: bool = True
    guidance_scale: Annotated[float, msgspec.Meta(ge=0)] = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dim % self.heads:
            raise ValueError(
                f"heads = {self.heads} must divide dim = {self.dim}; change one of them"
            )


class DitInputs(NamedTuple):
    """The arguments of ``TinyDit.forward``: one entry per request."""

    latents: list[torch.Tensor]  # B x (N_i, C)
    timesteps: torch.Tensor  # (B,) float
    context: list[torch.Tensor]  # B x (L_i, context_dim)


def sinusoid(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Embed ``values`` ``(N,)`` (timesteps or positions) as ``(N, dim)`` cosines and sines."""
    half = dim // 2
    freqs = torch.exp(
        -math.log(10_000.0) * torch.arange(half, device=values.device) / half
    )  # (dim/2,)
    angles = values.float()[:, None] * freqs[None, :]  # (N, dim/2)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)  # (N, dim)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Apply adaLN: ``x * (1 + scale) + shift``, all ``(T, E)``."""
    return x * (1 + scale) + shift


class DitSelfAttention(MultiheadProjections):
    """Self-attention over packed requests (varlen) or over one request (dense).

    Which one is fixed by the site's declared requirements, so the layer never runs a
    capability its backend was not chosen for.

    Args:
        dim: the model width E.
        site: the declared ``self`` site.
    """

    def __init__(self, dim: int, site: AttentionSite) -> None:
        super().__init__(dim, site.heads)
        self.is_varlen = site.requirements.packed_varlen
        self.attn = site.build_layer()
        self.sequence: SequenceGroups | None = None

    def attend(self, h: torch.Tensor, packing: Packing) -> torch.Tensor:
        """Attend each request's tokens to its own tokens: ``(T, E)`` to ``(T, E)``.

        Under sequence parallel ``h`` is this rank's shard and the other shards take
        part through ``attention.distributed`` (see ``packed_sequence_attention``).

        Raises:
            ValueError: several requests are packed but the site is not varlen.
        """
        q, k, v = self.project_qkv(h)  # (T, H, D)
        if self.sequence is not None:
            o = packed_sequence_attention(
                q,
                k,
                v,
                self.attn,
                packing.bounds,
                ulysses=self.sequence.ulysses,
                ring=self.sequence.ring,
                kv_gather=self.sequence.kv_gather,
                varlen=self.is_varlen,
            )  # (T, H, D)
            return self.project_out(o)
        if self.is_varlen:
            o = self.attn.forward_varlen(
                q,
                k,
                v,
                packing.cu_seqlens,
                packing.cu_seqlens,
                packing.max_seqlen,
                packing.max_seqlen,
            )  # (T, H, D)
            return self.project_out(o)
        if len(packing.counts) != 1:
            raise ValueError(
                f"{len(packing.counts)} requests were packed for a dense self-attention "
                "layer; run them one at a time, or set packed_sequences = true"
            )
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # (1, H, N, D)
        o = self.attn(q, k, v)  # (1, H, N, D)
        return self.project_out(o[0].transpose(0, 1))  # (N, E)


class DitCrossAttention(MultiheadProjections):
    """Cross-attention from each request's tokens to that request's text only.

    Args:
        dim: the model width E.
        context_dim: the width of the text embeddings.
        site: the declared ``cross`` site.
    """

    def __init__(self, dim: int, context_dim: int, site: AttentionSite) -> None:
        super().__init__(dim, site.heads, kdim=context_dim)
        self.attn = site.build_layer()

    def attend(
        self, h: torch.Tensor, packing: Packing, context: list[torch.Tensor]
    ) -> torch.Tensor:
        """Attend ``h`` ``(T, E)`` request by request to ``context``; returns ``(T, E)``.

        Padding rows (sequence parallel) attend to nothing and get zeros.
        """
        outs = []
        requests = torch.split(h, [*packing.counts, packing.padding])[:-1]
        for rows, text in zip(requests, context, strict=True):
            if rows.shape[0] == 0:
                continue  # this request has no tokens on this rank
            q = self.project_q(rows).transpose(0, 1)[None]  # (1, H, N_i, D)
            k, v = (t.transpose(0, 1)[None] for t in self.project_kv(text))  # (1, H, L_i, D)
            o = self.attn(q, k, v)  # (1, H, N_i, D)
            outs.append(self.project_out(o[0].transpose(0, 1)))  # (N_i, E)
        outs.append(h.new_zeros(packing.padding, h.shape[1]))
        return torch.cat(outs)  # (T, E)


class NativeSelfAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` (batch first) over each request alone; no packing."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__(dim, heads, batch_first=True)

    def attend(self, h: torch.Tensor, packing: Packing) -> torch.Tensor:
        """Attend each request's tokens to its own tokens: ``(T, E)`` to ``(T, E)``."""
        outs = []
        for rows in torch.split(h, packing.counts):
            x = rows[None]  # (1, N_i, E)
            outs.append(self(x, x, x, need_weights=False)[0][0])  # (N_i, E)
        return torch.cat(outs)


class NativeCrossAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` (batch first) from each request to its own text."""

    def __init__(self, dim: int, heads: int, context_dim: int) -> None:
        super().__init__(dim, heads, kdim=context_dim, vdim=context_dim, batch_first=True)

    def attend(
        self, h: torch.Tensor, packing: Packing, context: list[torch.Tensor]
    ) -> torch.Tensor:
        """Attend ``h`` ``(T, E)`` request by request to ``context``; returns ``(T, E)``."""
        outs = []
        for rows, text in zip(torch.split(h, packing.counts), context, strict=True):
            outs.append(self(rows[None], text[None], text[None], need_weights=False)[0][0])
        return torch.cat(outs)  # (T, E)


class DitBlock(nn.Module):
    """One DiT block: modulated self-attention, cross-attention, modulated MLP.

    Args:
        dim: the model width E.
        ffn_dim: the MLP's hidden width.
        self_attn: custom ``DitSelfAttention`` or ``NativeSelfAttention``.
        cross_attn: custom ``DitCrossAttention`` or ``NativeCrossAttention``.
    """

    def __init__(
        self,
        dim: int,
        ffn_dim: int,
        self_attn: DitSelfAttention | NativeSelfAttention,
        cross_attn: DitCrossAttention | NativeCrossAttention,
    ) -> None:
        super().__init__()
        # the modulated norms take their gain and shift from the timestep instead
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.self_attn = self_attn
        self.norm2 = nn.LayerNorm(dim)
        self.cross_attn = cross_attn
        self.norm3 = nn.LayerNorm(dim, elementwise_affine=False)
        self.mlp = nn.Sequential(
            nn.Linear(dim, ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(ffn_dim, dim)
        )
        self.modulation = nn.Linear(dim, 6 * dim)

    def forward(
        self, x: torch.Tensor, cond: torch.Tensor, packing: Packing, context: list[torch.Tensor]
    ) -> torch.Tensor:
        """Update packed tokens ``x`` ``(T, E)`` given per-request ``cond`` ``(B, E)``."""
        mod = packing.rows(self.modulation(silu(cond)))  # (T, 6E)
        shift1, scale1, gate1, shift2, scale2, gate2 = mod.chunk(6, dim=-1)  # (T, E) each
        h = modulate(self.norm1(x), shift1, scale1)
        x = x + gate1 * self.self_attn.attend(h, packing)
        x = x + self.cross_attn.attend(self.norm2(x), packing, context)
        h = modulate(self.norm3(x), shift2, scale2)
        out: torch.Tensor = x + gate2 * self.mlp(h)  # (T, E)
        return out


class TinyDit(StreamStack):
    """Predict, for each request's latent tokens, a tensor of the same shape.

    Args:
        options: the kind's options.
        blocks: the DiT blocks (custom or native attention).
        is_packed: run all requests as one packed sequence (custom varlen path only);
            otherwise one request per pass.
    """

    def __init__(self, options: TinyDitOptions, blocks: list[DitBlock], is_packed: bool) -> None:
        super().__init__()
        dim = options.dim
        self.dim = dim
        self.is_packed = is_packed
        self.proj_in = nn.Linear(options.in_channels, dim)
        self.t_mlp = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList(blocks)
        self.final_norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.final_modulation = nn.Linear(dim, 2 * dim)
        self.proj_out = nn.Linear(dim, options.in_channels)
        self.sequence: SequenceGroups | None = None

    def forward(
        self,
        latents: list[torch.Tensor],
        timesteps: torch.Tensor,
        context: list[torch.Tensor],
        cache: StepCache | None = None,
    ) -> list[torch.Tensor]:
        """Predict a tensor shaped like each request's latents.

        Args:
            latents: ``B x (N_i, C)``, the latent tokens of each request.
            timesteps: ``(B,)``, each request's diffusion timestep.
            context: ``B x (L_i, context_dim)``, each request's text embeddings (real
                tokens only: nothing masks padding here).
            cache: the step cache's view of this step (one row per request), or None
                to compute every block.

        Returns ``B x (N_i, C)``.

        Raises:
            ValueError: the three arguments disagree on the number of requests.
        """
        if not len(latents) == len(context) == timesteps.shape[0]:
            raise ValueError(
                f"got {len(latents)} latents, {timesteps.shape[0]} timesteps and "
                f"{len(context)} contexts; pass one of each per request"
            )
        if not latents:
            return []
        if cache is not None:
            return self._run_cached(latents, timesteps, context, cache)
        if self.is_packed:
            return self._run(latents, timesteps, context)
        return [
            self._run([x], t[None], [c])[0]
            for x, t, c in zip(latents, timesteps, context, strict=True)
        ]

    def _run(
        self, latents: list[torch.Tensor], timesteps: torch.Tensor, context: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Run the requests as one packed sequence of ``T`` tokens (this rank's shard of it)."""
        counts = [x.shape[0] for x in latents]
        packing = self._packing(counts, timesteps.device)
        x = self._local(packing, self._embed(latents))  # (T, E)
        cond = self.t_mlp(sinusoid(timesteps, self.dim))  # (B, E)
        for block in self.blocks:
            x = block(x, cond, packing, context)
        out = self._project(x, cond, packing)  # (T, C)
        if self.sequence is not None:
            out = gather_rows(out, self.sequence.sp)[: sum(counts)]  # (sum N_i, C) on every rank
        return list(torch.split(out, counts))

    def _run_cached(
        self,
        latents: list[torch.Tensor],
        timesteps: torch.Tensor,
        context: list[torch.Tensor],
        cache: StepCache,
    ) -> list[torch.Tensor]:
        """Run the requests under a step cache: whole rows in, the cache runs the blocks."""
        counts = [x.shape[0] for x in latents]
        cond = self.t_mlp(sinusoid(timesteps, self.dim))  # (B, E)
        streams = run_cached(
            self,
            Streams(
                text=torch.cat(context),
                image=self._embed(latents),
                text_counts=tuple(c.shape[0] for c in context),
                image_counts=tuple(counts),
                condition=cond,
            ),
            cache,
        )
        out = self._project(streams.image, cond, Packing.of(counts, timesteps.device))
        return list(torch.split(out, counts))

    def depth(self) -> int:
        """Return the blocks of the stack."""
        return len(self.blocks)

    def run_blocks(self, state: Streams, start: int, stop: int) -> Streams:
        """Run blocks ``start`` to ``stop`` on every request of ``state``: packed, or one
        request at a time where the self-attention is dense."""
        counts = list(state.image_counts)
        if not self.is_packed and len(counts) > 1:
            alone = [self.run_blocks(state.select([i]), start, stop) for i in range(len(counts))]
            return state.with_images([part.image for part in alone])
        packing = self._packing(counts, state.image.device)
        x = owned(self._local(packing, state.image), state.image)
        context = list(torch.split(state.text, list(state.text_counts)))
        for block in self.blocks[start:stop]:
            x = block(x, state.condition, packing, context)
        if self.sequence is not None:
            x = gather_rows(x, self.sequence.sp)[: sum(counts)]
        return state._replace(image=x)

    def _packing(self, counts: list[int], device: torch.device) -> Packing:
        """Describe the requests packed, sharded under sequence parallel."""
        sequence = self.sequence
        if sequence is None:
            return Packing.of(counts, device)
        return Packing.shard(counts, sequence.size, sequence.rank, device)

    def _local(self, packing: Packing, whole: torch.Tensor) -> torch.Tensor:
        """Return this rank's shard of whole packed rows ``(sum N_i, ...)`` (padding rows 0)."""
        sequence = self.sequence
        if sequence is None:
            return whole
        lo = sequence.rank * packing.token_requests.shape[0]
        hi = lo + packing.token_requests.shape[0]
        spare = max(0, hi - whole.shape[0])
        return pad(whole, (0, 0, 0, spare))[lo:hi]  # (T/P, E)

    def _embed(self, latents: list[torch.Tensor]) -> torch.Tensor:
        """Embed every request's tokens with their positions: ``(sum N_i, E)``."""
        device = latents[0].device
        positions = torch.cat([torch.arange(x.shape[0], device=device) for x in latents])
        embedded: torch.Tensor = self.proj_in(torch.cat(latents)) + sinusoid(positions, self.dim)
        return embedded

    def _project(self, x: torch.Tensor, cond: torch.Tensor, packing: Packing) -> torch.Tensor:
        """Modulate and project rows ``(T, E)`` to the latents' channels ``(T, C)``."""
        shift, scale = packing.rows(self.final_modulation(silu(cond))).chunk(2, dim=-1)  # (T, E)
        out: torch.Tensor = self.proj_out(modulate(self.final_norm(x), shift, scale))
        return out

    def parallelize(self, parallel: ComponentParallel) -> None:
        """Split this DiT over the ranks of ``parallel`` (sequence and tensor parallel).

        Sequence parallel shards the packed tokens (each block's self-attention reaches the
        other shards through ``attention.distributed``; cross-attention to the replicated
        text and the MLPs run on local rows). Tensor parallel shards each block's
        attention by heads and its MLP by hidden units with DTensor: q, k, v and the first
        MLP layer column-wise, the output projections row-wise (DTensor all-reduces them).
        """
        # imported here: torch.distributed.tensor costs ~0.6 CPU-s, which only a process
        # whose layout splits this DiT should pay
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            ParallelStyle,
            RowwiseParallel,
        )

        self.sequence = parallel.sequence
        for block in self.blocks:
            assert isinstance(block, DitBlock)
            if isinstance(block.self_attn, DitSelfAttention):
                block.self_attn.sequence = parallel.sequence
            if parallel.tensor is None:
                continue
            plan: dict[str, ParallelStyle] = {
                "mlp.0": ColwiseParallel(),
                "mlp.2": RowwiseParallel(),
            }
            for name in ("self_attn", "cross_attn"):
                projections = getattr(block, name)
                assert isinstance(projections, MultiheadProjections)
                projections.split_for_tensor_parallel()
                plan |= {f"{name}.{p}_proj": ColwiseParallel() for p in "qkv"}
                plan[f"{name}.out_proj"] = RowwiseParallel()
            split_layers(block, parallel.tensor, plan)


class TinyDitLoader(ComponentLoader):
    """Build ``tiny_dit``: the main transformer, strict about global backends."""

    kind: ClassVar[str] = "tiny_dit"
    options_type = TinyDitOptions
    allows_global_fallback = False
    sequence_parallel = True
    tensor_parallel = True
    guidance_parallel = True
    fully_shardable = True
    step_cache = True
    block_stack = "blocks"
    switchable_backends = True  # the denoiser: requests may name its backend (design §4.6)

    def __init__(self, options: TinyDitOptions) -> None:
        super().__init__(options)
        self.options: TinyDitOptions = options

    def sites(self) -> tuple[AttentionSite, ...]:
        """Declare ``self`` (packed varlen when ``packed_sequences``) and ``cross``."""
        opts = self.options
        packed = AttentionRequirements(packed_varlen=True)
        return (
            AttentionSite(
                name="self",
                role=AttentionRole.SELF,
                heads=opts.heads,
                requirements=packed if opts.packed_sequences else NO_REQUIREMENTS,
            ),
            AttentionSite(name="cross", role=AttentionRole.CROSS, heads=opts.heads),
        )

    def block_count(self) -> int:
        """Return the number of blocks layerwise offload streams."""
        return self.options.layers

    def tensors(self) -> DeclaredTensors:
        """Declare the stem, the blocks, the final modulation and the head."""
        o = self.options
        declared = {
            **tensors.linear("proj_in", o.in_channels, o.dim),
            **tensors.linear("t_mlp.0", o.dim, o.dim),
            **tensors.linear("t_mlp.2", o.dim, o.dim),
            **tensors.linear("final_modulation", o.dim, 2 * o.dim),
            **tensors.linear("proj_out", o.dim, o.in_channels),
        }
        for i in range(o.layers):
            at = f"blocks.{i}"
            declared |= {
                **tensors.attention_projections(f"{at}.self_attn", o.dim, o.dim),
                **tensors.norm(f"{at}.norm2", o.dim),
                **tensors.attention_projections(f"{at}.cross_attn", o.dim, o.context_dim),
                **tensors.linear(f"{at}.mlp.0", o.dim, o.ffn_dim),
                **tensors.linear(f"{at}.mlp.2", o.ffn_dim, o.dim),
                **tensors.linear(f"{at}.modulation", o.dim, 6 * o.dim),
            }
        return declared

    def reads(self) -> tuple[Port, ...]:
        """Read the context, ``context_dim`` wide, and latents of ``in_channels``."""
        o = self.options
        return (
            Port(field="context", width=o.context_dim, option="context_dim"),
            Port(field="latents", width=o.in_channels, option="in_channels"),
        )

    def writes(self) -> tuple[Port, ...]:
        """Write latents of ``in_channels``."""
        return (Port(field="latents", width=self.options.in_channels, option="in_channels"),)

    def run(self, module: nn.Module, batch: Batch) -> None:
        """Denoise the request's latents in ``batch.steps`` Euler steps, from noise if none.

        After each step ``batch.stepped`` reports it and drops the rows cancelled
        meanwhile; the other rows go on unchanged (each row's step reads only its own
        latents, text and timestep).

        With a guidance scale (the batch's, else the ``guidance_scale`` option) other than
        1 each step predicts with and without
        the text (classifier-free guidance): in one packed pass, or, under
        ``cfg_parallel``, the conditional branch on cfg rank 0 and the unconditional one
        on cfg rank 1, which then exchange their predictions.
        """
        h, w = batch.latent_size
        channels = self.options.in_channels
        device = device_of(module)
        latents = [
            x.to(device)
            for x in batch.latents
            or [torch.randn(h * w, channels, generator=batch.generator) for _ in range(batch.size)]
        ]  # (N, C) each
        empty = [torch.zeros(1, self.options.context_dim)] * batch.size
        context = [c.to(device) for c in batch.context or empty]  # (L_i, E) each
        negative = [c.to(device) for c in batch.negative_context or empty]
        scale = (
            self.options.guidance_scale if batch.guidance_scale is None else batch.guidance_scale
        )
        if self.cache is not None:
            batch.cache_rows = start_rows(self.cache, batch.cache_wanted(), batch.steps)
        try:
            for step in range(batch.steps):
                timesteps = torch.full(
                    (batch.size,), 1000.0 * (1 - step / batch.steps), device=device
                )
                if scale == 1:
                    predictions = module(
                        latents, timesteps, context, self._step_cache(batch, step, 1)
                    )
                else:
                    cond, uncond = self.predict_branches(
                        module, latents, timesteps, context, negative, step, batch
                    )
                    predictions = [u + scale * (c - u) for c, u in zip(cond, uncond, strict=True)]
                latents = [x - p / batch.steps for x, p in zip(latents, predictions, strict=True)]
                kept = batch.stepped(latents)  # cancelled rows leave here, before the next step
                if kept is not None:
                    latents = [latents[i] for i in kept]
                    context = [context[i] for i in kept]
                    negative = [negative[i] for i in kept]
        finally:
            release_caches(batch)
        batch.latents = latents

    def _step_cache(
        self, batch: Batch, step: int, branches: int, branch: int | None = None
    ) -> StepCache | None:
        """Return the step cache's view of ``step`` for a forward over ``branches`` guidance
        branches of the batch's rows (or over one, ``branch``, under CFG parallel), or None
        when no row of the batch runs a cache."""
        caches = batch.cache_rows
        if caches is None or not any_cached(caches):
            return None
        if branch is None:
            return StepCache(step, batch.steps, step_rows(caches, branches))
        group = None if self.parallel is None else self.parallel.guidance
        return StepCache(step, batch.steps, [(c, branch) for c in caches], group)

    def predict_branches(
        self,
        module: nn.Module,
        latents: list[torch.Tensor],
        timesteps: torch.Tensor,
        context: list[torch.Tensor],
        negative: list[torch.Tensor],
        step: int,
        batch: Batch,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Predict with the text and with the negative context: ``B x (N_i, C)`` each.

        Under a step cache each row's two branches decide together: in one forward, or
        on two cfg ranks that sum their measured parts first.
        """
        group = None if self.parallel is None else self.parallel.guidance
        if group is None:
            cache = self._step_cache(batch, step, 2)
            both = module(latents + latents, timesteps.repeat(2), context + negative, cache)
            return both[: len(latents)], both[len(latents) :]
        rank = dist.get_rank(group)
        cache = self._step_cache(batch, step, 2, branch=rank)
        mine = module(latents, timesteps, negative if rank else context, cache)
        rows = torch.cat(mine)  # (sum N_i, C)
        parts = [torch.empty_like(rows) for _ in range(2)]
        record("guidance", rows)
        dist.all_gather(parts, rows, group=group)  # [conditional, unconditional]
        counts = [x.shape[0] for x in latents]
        return list(torch.split(parts[0], counts)), list(torch.split(parts[1], counts))

    def build_custom(self) -> TinyDit:
        """Build the DiT on ``attention.Attention`` layers of sites ``self`` and ``cross``."""
        opts = self.options
        self_site, cross_site = self.sites()
        blocks = [
            DitBlock(
                opts.dim,
                opts.ffn_dim,
                DitSelfAttention(opts.dim, self_site),
                DitCrossAttention(opts.dim, opts.context_dim, cross_site),
            )
            for _ in range(opts.layers)
        ]
        return TinyDit(opts, blocks, is_packed=opts.packed_sequences)

    def parallelize(self, module: nn.Module, parallel: ComponentParallel) -> None:
        """Shard the packed tokens (sp) and the heads and MLP units (tp) of the DiT."""
        assert isinstance(module, TinyDit)
        module.parallelize(parallel)

    def build_native(self) -> TinyDit:
        """Build the DiT on ``nn.MultiheadAttention``, one request at a time."""
        opts = self.options
        blocks = [
            DitBlock(
                opts.dim,
                opts.ffn_dim,
                NativeSelfAttention(opts.dim, opts.heads),
                NativeCrossAttention(opts.dim, opts.heads, opts.context_dim),
            )
            for _ in range(opts.layers)
        ]
        return TinyDit(opts, blocks, is_packed=False)


def example_inputs(options: TinyDitOptions, batch: int, generator: torch.Generator) -> DitInputs:
    """Make ``batch`` seeded requests of different sizes.

    Request ``i`` has ``6 + 5 * (i % 3)`` latent tokens and ``3 + 2 * (i % 3)`` text tokens;
    timesteps are drawn from ``[0, 1000)``.
    """
    latents = [
        torch.randn(6 + 5 * (i % 3), options.in_channels, generator=generator) for i in range(batch)
    ]
    timesteps = torch.rand(batch, generator=generator) * 1000
    context = [
        torch.randn(3 + 2 * (i % 3), options.context_dim, generator=generator) for i in range(batch)
    ]
    return DitInputs(latents, timesteps, context)

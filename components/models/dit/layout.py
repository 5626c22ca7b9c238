"""Where each request's text and image tokens lie when several requests share one forward.

Request ``i`` brings ``L_i`` text tokens and ``N_i`` image tokens; in the packed joint
sequence its text comes first, then its image, and requests follow one another. Each
request has its own positions, rotary embeddings and modulation, and attends only to
its own tokens (varlen), so its output equals the request run alone.

Double-stream blocks (Flux, SD3) hold each stream's rows apart: the text rows of every
request back to back, and the image rows likewise; attention and single-stream blocks
hold the joint rows. Under sequence parallel a rank holds one contiguous shard of the
padded joint sequence (``components.models.packing.Packing.shard``): a request may
straddle ranks, and a rank may hold only part of its text or of its image.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
from torch.nn.functional import layer_norm

from components.mesh import SequenceGroups
from components.models.packing import Packing, gather_rows

__all__ = ["JointLayout", "Rows", "add_gated", "modulate"]

# B requests, E width, T joint rows on this rank, L_i / N_i text / image tokens of request i


class Rows(NamedTuple):
    """How the rows of one packed tensor on this rank divide among the requests.

    Request ``i`` owns ``counts[i]`` consecutive rows, in request order (0 when it has
    none here); ``padding`` rows follow them (sequence parallel pads the sequence).
    """

    counts: tuple[int, ...]
    padding: int = 0

    @property
    def owner(self) -> int | None:
        """Return the request owning every row, when one does (then values broadcast)."""
        if self.padding:
            return None
        owners = [i for i, count in enumerate(self.counts) if count]
        return owners[0] if len(owners) == 1 else None

    def spans(self) -> Iterator[tuple[int, int, int]]:
        """Yield ``(request, start, end)`` of every request with rows here."""
        start = 0
        for request, count in enumerate(self.counts):
            if count:
                yield request, start, start + count
            start += count


def modulate(
    x: torch.Tensor, rows: Rows, shift: torch.Tensor, scale: torch.Tensor, eps: float
) -> torch.Tensor:
    """Layer-normalise ``x`` ``(n, E)`` and modulate each request's rows by its own values.

    Returns ``norm(x) * (1 + scale_i) + shift_i`` for the rows of request ``i``, with
    ``shift`` and ``scale`` ``(B, E)``. The modulation is the norm's own affine, so each
    request costs one fused kernel; padding rows are normalised alone. ``x`` may hold
    no rows (a shard holding none of this stream).
    """
    width = (x.shape[-1],)
    owner = rows.owner
    if owner is not None:
        return layer_norm(x, width, 1 + scale[owner], shift[owner], eps)
    parts = [layer_norm(x[a:b], width, 1 + scale[i], shift[i], eps) for i, a, b in rows.spans()]
    if rows.padding or not parts:
        parts.append(layer_norm(x[x.shape[0] - rows.padding :], width, eps=eps))
    return torch.cat(parts)


def add_gated(x: torch.Tensor, y: torch.Tensor, rows: Rows, gate: torch.Tensor) -> torch.Tensor:
    """Add each request's rows of ``y``, times its ``gate`` ``(B, E)``, to ``x`` in place."""
    owner = rows.owner
    if owner is not None:
        return x.addcmul_(y, gate[owner])
    for i, a, b in rows.spans():
        x[a:b].addcmul_(y[a:b], gate[i])
    return x


class JointLayout:
    """Describe the packed joint sequence of a forward and this rank's share of it.

    Args:
        text: ``L_i`` per request (0 for a model without joint text, PixArt).
        image: ``N_i`` per request.
        device: where the index tensors go.
        sequence: the sequence-parallel groups, or None to hold every row.
    """

    def __init__(
        self,
        text: Sequence[int],
        image: Sequence[int],
        device: torch.device,
        sequence: SequenceGroups | None = None,
    ) -> None:
        counts = [t + n for t, n in zip(text, image, strict=True)]
        self.sequence = sequence
        self.total = sum(counts)
        if sequence is None:
            self.packing = Packing.of(counts, device)
            start, stop = 0, self.total
        else:
            self.packing = Packing.shard(counts, sequence.size, sequence.rank, device)
            start = sequence.rank * self.packing.token_requests.shape[0]
            stop = start + self.packing.token_requests.shape[0]
        self.start, self.stop = start, stop
        self.joint_rows = Rows(tuple(self.packing.counts), self.packing.padding)
        whole = sequence is None and len(counts) == 1
        self.text = _stream(text, [0] * len(text), counts, start, stop, device, whole)
        self.image = _stream(image, list(text), counts, start, stop, device, whole)
        self.split_at = text[0] if whole else None

    @property
    def rows(self) -> int:
        """Return how many joint rows this rank holds (padding included)."""
        return self.stop - self.start

    def local(self, whole: torch.Tensor) -> torch.Tensor:
        """Return this rank's rows of a tensor over the whole joint sequence ``(sum, ...)``."""
        if self.sequence is None:
            return whole
        spare = self.stop - whole.shape[0]
        if spare > 0:
            whole = torch.cat([whole, whole.new_zeros((spare, *whole.shape[1:]))])
        return whole[self.start : self.stop]

    def join(self, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        """Place the text rows ``(n_t, ...)`` and image rows ``(n_i, ...)`` in joint order."""
        if self.split_at is not None:
            return torch.cat([text, image])
        text_at, image_at = self._joint_indices()
        fill = torch.zeros if self.joint_rows.padding else torch.empty
        out = fill((self.rows, *text.shape[1:]), dtype=text.dtype, device=text.device)
        out.index_copy_(0, text_at, text)
        return out.index_copy_(0, image_at, image)

    def split(self, joint: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Take the text rows and the image rows out of joint rows ``(T, ...)``."""
        if self.split_at is not None:
            return joint[: self.split_at], joint[self.split_at :]
        text_at, image_at = self._joint_indices()
        return joint.index_select(0, text_at), joint.index_select(0, image_at)

    def _joint_indices(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.text.joint is None or self.image.joint is None:
            raise RuntimeError("a whole single request has no joint indices: use split_at")
        return self.text.joint, self.image.joint

    def gather(self, joint: torch.Tensor) -> torch.Tensor:
        """Return the whole joint sequence ``(sum L_i + N_i, C)`` from this rank's rows ``(T, C)``.

        Under sequence parallel every rank of the group gets the whole result.
        """
        if self.sequence is None:
            return joint
        return gather_rows(joint, self.sequence.sp)[: self.total]

    def gather_image(self, image: torch.Tensor) -> torch.Tensor:
        """Return every request's image rows ``(sum N_i, C)`` from this rank's ``(n_i, C)``.

        Under sequence parallel every rank of the group gets the whole result.
        """
        if self.sequence is None:
            return image
        joint = image.new_zeros((self.rows, image.shape[1]))
        joint.index_copy_(0, self._joint_indices()[1], image)
        everything = self.gather(joint)  # (sum L_i + N_i, C)
        return everything.index_select(0, self._positions(image.device, text=False))

    def gather_streams(
        self, text: torch.Tensor, image: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return every request's text rows ``(sum L_i, E)`` and image rows ``(sum N_i, E)``
        from this rank's ``(n_t, E)`` and ``(n_i, E)``, in one gather.

        Under sequence parallel every rank of the group gets the whole result.
        """
        if self.sequence is None:
            return text, image
        everything = self.gather(self.join(text, image))  # (sum L_i + N_i, E)
        device = image.device
        return (
            everything.index_select(0, self._positions(device, text=True)),
            everything.index_select(0, self._positions(device, text=False)),
        )

    def _positions(self, device: torch.device, *, text: bool) -> torch.Tensor:
        """Return where every request's text (or image) tokens lie in the whole joint sequence."""
        return torch.cat(
            [
                torch.arange(a, a + t, device=device)
                if text
                else torch.arange(a + t, b, device=device)
                for t, (a, b) in self._requests()
            ]
        )

    def _requests(self) -> Iterator[tuple[int, tuple[int, int]]]:
        """Yield each request's text length and the bounds of its joint tokens."""
        bounds = self.packing.cu_seqlens
        for i, text in enumerate(self.text.lengths):
            yield text, (bounds[i], bounds[i + 1])


class StreamPart(NamedTuple):
    """The rows of one stream (text or image) of every request held on this rank.

    Attributes:
        rows: how they divide among the requests.
        source: each row's index in the whole stream (every request's tokens of this
            stream back to back); None when this rank holds the whole stream.
        joint: each row's index among this rank's joint rows; None when the joint rows
            are simply the text's then the image's (one request, unsharded).
        lengths: every request's tokens of this stream (on all ranks).
    """

    rows: Rows
    source: torch.Tensor | None
    joint: torch.Tensor | None
    lengths: tuple[int, ...]

    def take(self, whole: torch.Tensor) -> torch.Tensor:
        """Return this rank's rows of the whole stream ``(sum, ...)``."""
        return whole if self.source is None else whole.index_select(0, self.source)


def _stream(
    lengths: Sequence[int],
    offsets: Sequence[int],
    counts: Sequence[int],
    start: int,
    stop: int,
    device: torch.device,
    whole: bool,
) -> StreamPart:
    """Find one stream's rows on a rank holding joint rows ``start:stop``.

    Request ``i``'s tokens of this stream lie ``offsets[i]`` rows into its joint tokens.
    """
    if whole:
        return StreamPart(Rows(tuple(lengths)), None, None, tuple(lengths))
    here, source, joint = [], [], []
    request_start, stream_start = 0, 0
    for length, offset, count in zip(lengths, offsets, counts, strict=True):
        lo = max(start, request_start + offset)
        hi = min(stop, request_start + offset + length)
        taken = max(0, hi - lo)
        here.append(taken)
        if taken:
            first = lo - request_start - offset  # the first of its stream rows held here
            source.append(torch.arange(stream_start + first, stream_start + first + taken))
            joint.append(torch.arange(lo - start, hi - start))
        request_start += count
        stream_start += length
    empty = torch.zeros(0, dtype=torch.int64)
    return StreamPart(
        Rows(tuple(here)),
        torch.cat(source or [empty]).to(device),
        torch.cat(joint or [empty]).to(device),
        tuple(lengths),
    )

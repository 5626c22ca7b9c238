"""The process groups of a parallel layout: one named ``DeviceMesh`` and what each component gets.

Rank order, outermost first: ``dp``, ``cfg``, then the sequence dims (``ring`` x
``ulysses``, or ``kv_gather``), then ``tp``. Ulysses sits inside ring so the ranks of one
Ulysses group hold consecutive token shards: their all-to-all rebuilds one ring chunk.
The flattened ``sp`` dim orders the token shards; the flattened ``replica`` dim (cfg x sp
x tp) is what FSDP shards over, the ranks that serve one request in lockstep.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from components.layout import ParallelLayout

__all__ = ["ComponentParallel", "ParallelMesh", "SequenceGroups"]


@dataclass(frozen=True)
class SequenceGroups:
    """The groups sequence parallelism runs on; a group of one rank is None.

    Attributes:
        sp: every rank holding a token shard of the same sequence, in shard order.
        ulysses: the ranks that trade sequence shards for head shards (all-to-all).
        ring: the ranks K/V blocks travel around (LSE merge).
        kv_gather: the ranks that all-gather K/V.
    """

    sp: dist.ProcessGroup
    ulysses: dist.ProcessGroup | None
    ring: dist.ProcessGroup | None
    kv_gather: dist.ProcessGroup | None

    @property
    def size(self) -> int:
        """Return how many token shards the sequence is cut into."""
        return dist.get_world_size(self.sp)

    @property
    def rank(self) -> int:
        """Return which token shard this rank holds."""
        return dist.get_rank(self.sp)


@dataclass(frozen=True)
class ComponentParallel:
    """How one component is split on this rank; None fields replicate.

    Attributes:
        sequence: the sequence-parallel groups (a kind that implements sequence parallel).
        tensor: the 1-D ``tp`` mesh (a kind that implements tensor parallel).
        fsdp: the 1-D ``replica`` mesh FSDP2 shards the weights over.
        guidance: the ``cfg`` group whose two ranks run the conditional (cfg rank 0) and
            unconditional (cfg rank 1) branches of classifier-free guidance.
    """

    sequence: SequenceGroups | None = None
    tensor: DeviceMesh | None = None
    fsdp: DeviceMesh | None = None
    guidance: dist.ProcessGroup | None = None

    @property
    def shards_weights(self) -> bool:
        """Tell whether the weights become DTensor shards (tensor parallel or FSDP)."""
        return self.tensor is not None or self.fsdp is not None


class ParallelMesh:
    """The named ``DeviceMesh`` of one layout on this rank.

    Needs an initialised default process group of ``layout.world_size`` ranks.

    Args:
        layout: the admitted layout.
        device_type: ``cpu`` (gloo) or ``cuda`` (NCCL).
    """

    def __init__(self, layout: ParallelLayout, device_type: str) -> None:
        self.layout = layout
        sequence = (
            {"kv_gather": layout.kv_gather_degree}
            if layout.kv_gather_degree > 1
            else {"ring": layout.ring_degree, "ulysses": layout.ulysses_degree}
        )
        dims = {
            "dp": layout.dp_size,
            "cfg": 2 if layout.cfg_parallel else 1,
            **sequence,
            "tp": layout.tp_size,
        }
        self._sequence_dims = tuple(sequence)
        self.mesh, self._flat = _device_meshes(device_type, dims, self._sequence_dims)

    def dim(self, name: str) -> DeviceMesh:
        """Return the 1-D mesh along ``name`` (``dp``, ``cfg``, ``sp``, ``replica``, ``tp``...)."""
        return self._flat.get(name) or self.mesh[name]

    def size(self, dim: str) -> int:
        """Return the size of mesh dim ``dim``."""
        return self.dim(dim).size()

    def local_rank(self, dim: str) -> int:
        """Return this rank's coordinate along ``dim``."""
        return self.dim(dim).get_local_rank()

    def group(self, dim: str) -> dist.ProcessGroup:
        """Return the process group along ``dim``."""
        return self.dim(dim).get_group()

    def sequence_groups(self) -> SequenceGroups | None:
        """Return the sequence-parallel groups, None when sp_degree is 1."""
        if self.layout.sp_degree == 1:
            return None

        def split(dim: str) -> dist.ProcessGroup | None:
            if dim not in self._sequence_dims or self.size(dim) == 1:
                return None
            return self.group(dim)

        return SequenceGroups(
            sp=self.group("sp"),
            ulysses=split("ulysses"),
            ring=split("ring"),
            kv_gather=split("kv_gather"),
        )

    def for_component(
        self,
        name: str,
        *,
        sequence_parallel: bool,
        tensor_parallel: bool,
        guidance_parallel: bool = False,
    ) -> ComponentParallel:
        """Return how component ``name`` is split, given what its kind implements."""
        return ComponentParallel(
            guidance=self.group("cfg") if guidance_parallel and self.layout.cfg_parallel else None,
            sequence=self.sequence_groups() if sequence_parallel else None,
            tensor=self.dim("tp") if tensor_parallel and self.layout.tp_size > 1 else None,
            fsdp=self.dim("replica") if name in self.layout.fsdp else None,
        )


_built: dict[tuple[object, ...], tuple[DeviceMesh, dict[str, DeviceMesh]]] = {}
"""The meshes built on this process's default group, by device type and dims."""


def _device_meshes(
    device_type: str, dims: dict[str, int], sequence_dims: tuple[str, ...]
) -> tuple[DeviceMesh, dict[str, DeviceMesh]]:
    """Return the named mesh of ``dims`` and its flattened ``sp`` and ``replica`` dims.

    Built once per default process group, then reused: the groups a mesh makes live as
    long as the process, and each keeps threads (a two-rank Ulysses mesh on gloo: 4
    groups, 12 threads, whose event loops wake while idle). A rank that had built 40
    meshes held 484 threads and spent 55-90 ms of CPU a second doing nothing; a process
    that loads a layout again now holds one set.
    """
    world = dist.group.WORLD
    if any(key[0] is not world for key in _built):
        _built.clear()  # a new default group: the old one's groups are gone with it
    key = (world, device_type, *dims.items())
    if key not in _built:
        mesh = init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))
        # torch wants flattened dims kept by the caller, not sliced from the root again
        _built[key] = (
            mesh,
            {
                "sp": mesh[sequence_dims]._flatten("sp"),
                "replica": mesh[("cfg", *sequence_dims, "tp")]._flatten("replica"),
            },
        )
    return _built[key]

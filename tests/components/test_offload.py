"""Weight stores: host and disk offload, whole or block by block, checked on a real model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from components.accounting import module_bytes
from components.offload import DiskStore, HostStore, LayerwiseStore, OffloadError, WeightStore
from components.offload.aligned_file import PADDING
from components.weights import seed_weights

VOCAB, DIM, SEQ, BLOCKS = 64, 32, 8, 4


class Block(nn.Module):
    """A pre-norm MLP block with a persistent per-block gain buffer."""

    gain: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)
        self.register_buffer("gain", torch.ones(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.gain * self.down(nn.functional.gelu(self.up(self.norm(x))))
        return out


class TinyLM(nn.Module):
    """Embedding, blocks, and a head tied to the embedding; one buffer of each kind."""

    scale: torch.Tensor
    positions: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(()))
        self.register_buffer("positions", torch.linspace(-1, 1, SEQ * DIM), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens: B S -> logits: B S V
        x = self.embed(tokens) * self.scale + self.positions.view(SEQ, DIM)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


def build(seed: int = 0) -> TinyLM:
    """Return a TinyLM on the host whose weights and buffers depend only on ``seed``."""
    model = TinyLM().eval()
    seed_weights(model, seed)
    return model


TOKENS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


def run(model: nn.Module, device: str = "cpu") -> torch.Tensor:
    """Return the model's logits for the fixed batch, on the host."""
    with torch.inference_mode():
        out: torch.Tensor = model(TOKENS.to(device))
    return out.cpu()


def _raise_runtime_error(module: nn.Module, args: tuple[object, ...]) -> None:
    raise RuntimeError("block 2 failed")


def all_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Return every parameter and buffer by every name, ties and non-persistent ones included."""
    return [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]


def block_bytes(model: TinyLM) -> int:
    """Return the bytes of one block (all blocks are the same size)."""
    return module_bytes(model.blocks[0])


class TestDiskStore:
    def test_offload_frees_every_tensor(self, tmp_path: Path) -> None:
        """Construction offloads: every parameter and buffer becomes a 0-element placeholder."""
        model = build()
        store = DiskStore(model, tmp_path / "lm.safetensors", "cpu")
        assert not store.is_resident
        assert store.resident_bytes() == 0
        assert module_bytes(model) == 0
        for name, tensor in all_tensors(model):
            assert tensor.numel() == 0, name
            assert tensor.untyped_storage().nbytes() == 0, name
        assert model.embed.weight.dtype == torch.float32

    def test_file_holds_the_weights(self, tmp_path: Path) -> None:
        """The file holds every parameter and buffer, the tied weight once, equal to the model's."""
        reference = build()
        DiskStore(build(), tmp_path / "lm.safetensors", "cpu")
        stored = load_file(tmp_path / "lm.safetensors")
        stored = {name: t for name, t in stored.items() if not name.startswith(PADDING)}
        expected = dict(all_tensors(reference))
        assert set(stored) == set(expected) - {"head.weight"}
        for name, tensor in stored.items():
            assert torch.equal(tensor, expected[name]), name

    def test_round_trip_is_bit_identical(self, tmp_path: Path) -> None:
        """Outputs after each of two round trips equal the never-offloaded model's, bit for bit."""
        expected = run(build())
        model = build()
        store = DiskStore(model, tmp_path / "lm.safetensors", "cpu")
        for _ in range(2):
            assert store.onload() == module_bytes(build())
            assert torch.equal(run(model), expected)
            assert store.offload() == store.nbytes

    def test_ties_survive(self, tmp_path: Path) -> None:
        """Tied names keep one Parameter object through a round trip, and stay tied after it."""
        model = build()
        parameters = list(model.parameters())
        store = DiskStore(model, tmp_path / "lm.safetensors", "cpu")
        store.onload()
        assert list(model.parameters()) == parameters
        assert model.head.weight is model.embed.weight
        with torch.no_grad():
            model.embed.weight[3, 5] = 42.0
        assert model.head.weight[3, 5] == 42.0

    def test_buffers_survive(self, tmp_path: Path) -> None:
        """Persistent and non-persistent buffers come back equal and stay the same objects."""
        reference = build()
        model = build()
        with torch.no_grad():
            model.scale.fill_(1.5)
            reference.scale.fill_(1.5)
        buffers = list(model.buffers())
        store = DiskStore(model, tmp_path / "lm.safetensors", "cpu")
        store.onload()
        assert list(model.buffers()) == buffers
        for (name, got), (_, want) in zip(
            model.named_buffers(), reference.named_buffers(), strict=True
        ):
            assert torch.equal(got, want), name

    def test_missing_file_leaves_module_offloaded(self, tmp_path: Path) -> None:
        """Onload after the file is deleted raises a clear error and leaves placeholders."""
        path = tmp_path / "lm.safetensors"
        model = build()
        store = DiskStore(model, path, "cpu")
        path.unlink()
        with pytest.raises(OffloadError) as err:
            store.onload()
        assert str(err.value) == (
            f"offload file {path} is missing: it held the only copy of the offloaded weights, "
            "so they cannot be onloaded and the module stays offloaded; close the pipeline "
            "and load it afresh in a new orchestrator to rewrite the file, and keep the offload "
            "directory out of reach of cleaners"
        )
        assert not store.is_resident
        assert store.resident_bytes() == 0
        assert all(tensor.numel() == 0 for _, tensor in all_tensors(model))

    def test_changed_file_is_refused(self, tmp_path: Path) -> None:
        """A file replaced by other weights is refused, naming the changed tensors."""
        path = tmp_path / "lm.safetensors"
        model = build()
        store = DiskStore(model, path, "cpu")
        save_file({"embed.weight": torch.zeros(2, 2)}, path)
        with pytest.raises(OffloadError, match="was changed after it was written"):
            store.onload()
        assert module_bytes(model) == 0

    def test_truncated_file_is_refused(self, tmp_path: Path) -> None:
        """A file cut short is refused and the module stays offloaded."""
        path = tmp_path / "lm.safetensors"
        model = build()
        store = DiskStore(model, path, "cpu")
        path.write_bytes(path.read_bytes()[:-100])
        with pytest.raises(OffloadError, match="ends inside tensor"):
            store.onload()
        assert module_bytes(model) == 0

    def test_resident_start_writes_at_first_offload(self, tmp_path: Path) -> None:
        """A store started resident moves nothing and writes its file at the first offload."""
        path = tmp_path / "lm.safetensors"
        model = build()
        store = DiskStore(model, path, "cpu", resident=True)
        assert store.is_resident
        assert store.resident_bytes() == module_bytes(model) == store.nbytes
        assert not path.exists()
        assert store.offload() == store.nbytes
        assert path.exists()

    def test_file_deleted_while_resident_is_rewritten(self, tmp_path: Path) -> None:
        """Offload writes the file again when it vanished while the weights were in memory."""
        path = tmp_path / "lm.safetensors"
        model = build()
        store = DiskStore(model, path, "cpu")
        store.onload()
        path.unlink()
        store.offload()
        store.onload()
        assert torch.equal(run(model), run(build()))

    def test_close_deletes_the_file(self, tmp_path: Path) -> None:
        """Close deletes the file, and a closed store refuses to move weights."""
        path = tmp_path / "lm.safetensors"
        store = DiskStore(build(), path, "cpu")
        store.close()
        assert not path.exists()
        with pytest.raises(OffloadError, match="is closed"):
            store.onload()


class TestHostStore:
    def test_round_trip_keeps_outputs_and_accounting(self) -> None:
        """On CPU, offload and onload keep outputs identical and account the module's bytes."""
        expected = run(build())
        model = build()
        store = HostStore(model, "cpu")
        assert not store.is_resident
        assert store.resident_bytes() == 0
        for _ in range(2):
            assert store.onload() == module_bytes(model) == store.nbytes
            assert store.resident_bytes() == store.nbytes
            assert torch.equal(run(model), expected)
            assert store.offload() == store.nbytes
            assert store.resident_bytes() == 0

    def test_cpu_moves_nothing(self) -> None:
        """On CPU every tensor keeps its storage through offload and onload."""
        model = build()
        pointers = [tensor.data_ptr() for _, tensor in all_tensors(model)]
        store = HostStore(model, "cpu", resident=True)
        store.offload()
        store.onload()
        assert [tensor.data_ptr() for _, tensor in all_tensors(model)] == pointers

    def test_repeated_moves_return_zero(self) -> None:
        """Onloading a resident store or offloading an offloaded one moves nothing."""
        store = HostStore(build(), "cpu", resident=True)
        assert store.onload() == 0
        store.offload()
        assert store.offload() == 0

    def test_prefetch_reserves_until_onload(self) -> None:
        """Prefetch returns the bytes to reserve once; they count as resident only after onload."""
        store = HostStore(build(), "cpu")
        assert store.prefetch() == store.nbytes
        assert store.prefetch() == 0
        assert store.resident_bytes() == 0
        assert store.onload() == store.nbytes
        assert store.resident_bytes() == store.nbytes

    def test_closed_store_refuses(self) -> None:
        """A closed store refuses to move weights, saying how to recover."""
        store = HostStore(build(), "cpu")
        store.close()
        with pytest.raises(OffloadError) as err:
            store.onload()
        assert str(err.value) == (
            "the HostStore of TinyLM is closed, so its weights can no longer move; "
            "build a new store for a loaded module"
        )


class TestWeightStore:
    def test_stores_share_the_contract(self, tmp_path: Path) -> None:
        """Every store is a WeightStore whose accounted bytes are the module's."""
        layered = build()
        stores: list[WeightStore] = [
            HostStore(build(), "cpu"),
            DiskStore(build(), tmp_path / "a.safetensors", "cpu"),
            LayerwiseStore(layered, layered.blocks, target="host", device="cpu"),
        ]
        assert {store.nbytes for store in stores} == {module_bytes(build())}

    def test_unmaterialised_module_is_refused(self, tmp_path: Path) -> None:
        """A module with meta tensors is refused, naming every one and the fix."""
        with torch.device("meta"):
            model = nn.Linear(2, 3)
        with pytest.raises(OffloadError) as err:
            DiskStore(model, tmp_path / "a.safetensors", "cpu")
        assert str(err.value) == (
            "cannot keep the weights of Linear in a store: 'weight' is on meta, not on the "
            "host CPU; 'bias' is on meta, not on the host CPU; build the module on the host "
            "CPU with its weights loaded (as a loader returns it), and tie weights by "
            "assigning one nn.Parameter to both names"
        )

    def test_views_sharing_storage_are_refused(self, tmp_path: Path) -> None:
        """Two distinct tensors over one storage are refused: a store could not keep them tied."""
        model = nn.Module()
        base = torch.zeros(4, 4)
        model.a = nn.Parameter(base)
        model.b = nn.Parameter(base[0])
        with pytest.raises(OffloadError, match="'b' shares its storage with 'a'"):
            HostStore(model, "cpu")

    def test_views_are_compacted(self) -> None:
        """A tensor viewing a larger storage is compacted so accounting is exact."""
        model = nn.Module()
        model.a = nn.Parameter(torch.arange(16.0).view(4, 4).t())
        store = HostStore(model, "cpu", resident=True)
        assert model.a.is_contiguous()
        assert torch.equal(model.a, torch.arange(16.0).view(4, 4).t())
        assert store.resident_bytes() == module_bytes(model) == 64


def watch_blocks(model: TinyLM, store: LayerwiseStore) -> list[int]:
    """Record the store's resident bytes as each block starts running."""
    seen: list[int] = []
    for block in model.blocks:
        # registered after the store's own hook, so it sees the block streamed in
        block.register_forward_pre_hook(lambda *_: seen.append(store.resident_bytes()))
    return seen


class TestLayerwiseStore:
    @pytest.mark.parametrize("target", ["host", "disk"])
    @pytest.mark.parametrize("prefetch", [0, 1, 2])
    @pytest.mark.parametrize("resident_layers", [0, 1])
    def test_streams_within_bound_bit_identical(
        self, tmp_path: Path, target: str, prefetch: int, resident_layers: int
    ) -> None:
        """Outputs equal a resident run bit for bit, and the peak stays within the bound."""
        expected = run(build())
        model = build()
        path = tmp_path / "lm.safetensors" if target == "disk" else None
        store = LayerwiseStore(
            model,
            model.blocks,
            target="disk" if target == "disk" else "host",
            path=path,
            device="cpu",
            prefetch=prefetch,
            resident_layers=resident_layers,
        )
        block = block_bytes(model if target == "host" else build())
        rest = store.nbytes - BLOCKS * block
        assert store.onload() == rest + resident_layers * block
        for _ in range(2):
            assert torch.equal(run(model), expected)
            bound = rest + min(resident_layers + prefetch + 1, BLOCKS) * block
            assert rest + block <= store.peak_bytes <= bound
            assert store.resident_bytes() == rest + resident_layers * block

    def test_accounting_follows_each_block(self) -> None:
        """With prefetch 1 the resident layer, the running block and the next one are resident."""
        model = build()
        block = block_bytes(model)
        store = LayerwiseStore(
            model, model.blocks, target="host", device="cpu", prefetch=1, resident_layers=1
        )
        rest = store.nbytes - BLOCKS * block
        seen = watch_blocks(model, store)
        store.onload()
        run(model)
        assert seen == [rest + 2 * block, rest + 3 * block, rest + 3 * block, rest + 2 * block]

    def test_disk_frees_blocks_after_forward(self, tmp_path: Path) -> None:
        """After a forward on disk target, streamed blocks are placeholders again."""
        model = build()
        block = block_bytes(model)
        store = LayerwiseStore(
            model,
            model.blocks,
            target="disk",
            path=tmp_path / "lm.safetensors",
            device="cpu",
            resident_layers=1,
        )
        store.onload()
        run(model)
        assert module_bytes(model.blocks[0]) == block
        for streamed in model.blocks[1:]:
            assert all(tensor.numel() == 0 for _, tensor in all_tensors(streamed))
        assert module_bytes(model) == store.resident_bytes() == store.nbytes - 3 * block

    def test_forward_that_raises_streams_its_blocks_back_out(self, tmp_path: Path) -> None:
        """A forward failing mid-stack frees its streamed blocks and lets the next one run."""
        model = build()
        store = LayerwiseStore(
            model, model.blocks, target="disk", path=tmp_path / "lm.safetensors", device="cpu"
        )
        store.onload()
        resident = store.resident_bytes()
        boom = model.blocks[2].register_forward_pre_hook(_raise_runtime_error)
        with pytest.raises(RuntimeError, match="block 2 failed"):
            run(model)
        boom.remove()
        assert store.resident_bytes() == resident
        assert torch.isfinite(run(model)).all()

    def test_offloaded_means_everything_out(self, tmp_path: Path) -> None:
        """An offloaded layerwise store holds nothing: every tensor is a placeholder."""
        model = build()
        store = LayerwiseStore(
            model,
            model.blocks,
            target="disk",
            path=tmp_path / "lm.safetensors",
            device="cpu",
            resident_layers=2,
            resident=True,
        )
        run(model)
        assert store.offload() == store.nbytes - 2 * block_bytes(build())
        assert store.resident_bytes() == 0
        assert all(tensor.numel() == 0 for _, tensor in all_tensors(model))

    def test_ties_survive_on_disk(self, tmp_path: Path) -> None:
        """The tied embedding and head stay one Parameter through a layerwise round trip."""
        model = build()
        parameters = list(model.parameters())
        store = LayerwiseStore(
            model, model.blocks, target="disk", path=tmp_path / "lm.safetensors", device="cpu"
        )
        store.onload()
        run(model)
        assert list(model.parameters()) == parameters
        assert model.head.weight is model.embed.weight

    def test_running_while_offloaded_is_refused(self) -> None:
        """Running the module while its store is offloaded raises instead of computing."""
        model = build()
        LayerwiseStore(model, model.blocks, target="host", device="cpu")
        with pytest.raises(OffloadError) as err:
            run(model)
        assert str(err.value) == (
            "TinyLM ran while its LayerwiseStore is offloaded, so its non-block weights are "
            "not on the device; onload() the store before running the module"
        )

    def test_missing_file_fails_the_block_and_keeps_it_out(self, tmp_path: Path) -> None:
        """A block whose file vanished fails its forward and stays a placeholder."""
        path = tmp_path / "lm.safetensors"
        model = build()
        store = LayerwiseStore(model, model.blocks, target="disk", path=path, device="cpu")
        store.onload()
        path.unlink()
        with pytest.raises(OffloadError, match="is missing"):
            run(model)
        assert all(tensor.numel() == 0 for _, tensor in all_tensors(model.blocks[0]))

    def test_failed_onload_undoes_what_it_did(self, tmp_path: Path) -> None:
        """An onload that fails on a resident layer leaves the non-block weights out too."""
        path = tmp_path / "lm.safetensors"
        model = build()
        store = LayerwiseStore(
            model, model.blocks, target="disk", path=path, device="cpu", resident_layers=1
        )
        # same-length header edit: the non-block tensors still read, block 0 does not
        entry = b'"blocks.0.up.weight":{"dtype":"F32","shape":['
        path.write_bytes(path.read_bytes().replace(entry + b"128,32]", entry + b"32,128]"))
        with pytest.raises(OffloadError, match=r"was changed after it was written \(blocks.0.up"):
            store.onload()
        assert not store.is_resident
        assert store.resident_bytes() == 0
        assert all(tensor.numel() == 0 for _, tensor in all_tensors(model))

    def test_bad_arguments_are_all_named(self) -> None:
        """Every unusable argument is named in one error, with its fix."""
        model = build()
        with pytest.raises(OffloadError) as err:
            LayerwiseStore(
                model,
                nn.ModuleList([nn.Linear(2, 2)]),
                target="disk",
                device="cpu",
                prefetch=-1,
                resident_layers=3,
            )
        assert str(err.value) == (
            "cannot build a LayerwiseStore for TinyLM: target 'disk' needs a path for its "
            "safetensors file; prefetch is -1; use 0 or more blocks; resident_layers is 3; "
            "use 0 to 1; blocks are not submodules of TinyLM; pass its own"
        )

    def test_close_removes_the_hooks(self, tmp_path: Path) -> None:
        """After close the module runs without the store's hooks and the file is gone."""
        path = tmp_path / "lm.safetensors"
        model = build()
        store = LayerwiseStore(
            model, model.blocks, target="disk", path=path, device="cpu", resident=True
        )
        store.close()
        assert not path.exists()
        assert not any(block._forward_pre_hooks for block in model.blocks)


@pytest.mark.cuda
class TestCuda:
    def test_host_store_pins_and_copies_on_a_stream(self) -> None:
        """On CUDA the master is pinned, onload copies it in, and offload swaps pointers back."""
        expected = run(build().cuda(), "cuda")
        model = build()
        store = HostStore(model, "cuda")
        masters = [tensor.data_ptr() for _, tensor in all_tensors(model)]
        assert all(tensor.is_pinned() for _, tensor in all_tensors(model))
        assert store.prefetch() == store.nbytes
        assert store.resident_bytes() == 0
        assert store.onload() == store.nbytes
        assert all(tensor.is_cuda for _, tensor in all_tensors(model))
        assert torch.equal(run(model, "cuda"), expected)
        assert store.offload() == store.nbytes
        assert [tensor.data_ptr() for _, tensor in all_tensors(model)] == masters
        assert store.resident_bytes() == 0

    def test_offload_during_prefetch_frees_the_copy(self) -> None:
        """Offloading a store whose prefetch is in flight waits for it and frees the memory."""
        model = build()
        store = HostStore(model, "cuda")
        before = torch.cuda.memory_allocated()
        store.prefetch()
        assert store.offload() == 0
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before
        assert all(tensor.is_pinned() for _, tensor in all_tensors(model))

    def test_disk_store_round_trip(self, tmp_path: Path) -> None:
        """On CUDA a disk round trip frees device memory and gives identical outputs."""
        expected = run(build().cuda(), "cuda")
        model = build()
        store = DiskStore(model, tmp_path / "lm.safetensors", "cuda")
        before = torch.cuda.memory_allocated()
        store.onload()
        assert torch.cuda.memory_allocated() - before >= store.nbytes
        assert torch.equal(run(model, "cuda"), expected)
        store.offload()
        assert torch.cuda.memory_allocated() == before
        assert model.head.weight is model.embed.weight

    @pytest.mark.parametrize("target", ["host", "disk"])
    @pytest.mark.parametrize("prefetch", [0, 1, 2])
    def test_layerwise_streams(self, tmp_path: Path, target: str, prefetch: int) -> None:
        """On CUDA layerwise offload is bit-identical and stays within the bound."""
        expected = run(build().cuda(), "cuda")
        model = build()
        block = block_bytes(model)
        store = LayerwiseStore(
            model,
            model.blocks,
            target="disk" if target == "disk" else "host",
            path=tmp_path / "lm.safetensors" if target == "disk" else None,
            device="cuda",
            prefetch=prefetch,
        )
        rest = store.nbytes - BLOCKS * block
        store.onload()
        for _ in range(2):
            assert torch.equal(run(model, "cuda"), expected)
            assert store.peak_bytes <= rest + (prefetch + 1) * block
            assert store.resident_bytes() == rest

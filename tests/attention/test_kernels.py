"""Every kernel against the float64 reference: shapes, dtypes, GQA, masks, varlen, LSE."""

from __future__ import annotations

import math

import pytest
import torch

from attention import AttentionImpl, Platform, registry
from attention.backends import SlidingWindowOptions
from attention.testing import TOLERANCE, RandomInputs, count_attention_flops, rel_err, run_dense

# B batch, H heads, S seq, D head dim, T packed tokens

# parametrize lists are made at collection, before any fixture exists
DENSE = [
    n for n in registry.names() if Platform("cpu").is_available(n) and not registry.get(n).is_sparse
]
MASKED = [n for n in DENSE if registry.get(n).supports_mask()]
VARLEN = [n for n in DENSE if registry.get(n).supports_varlen()]
LSE = [n for n in DENSE if registry.get(n).supports_lse()]
BIASED = [n for n in DENSE if registry.get(n).supports_bias()]
CAUSAL = [n for n in DENSE if registry.get(n).supports_causal()]

# (B, Hq, Hk, Sq, Sk, D): one token, equal heads, grouped-query, cross lengths, long-ish.
Shape = tuple[int, int, int, int, int, int]
SHAPES: list[Shape] = [
    (1, 1, 1, 1, 1, 8),
    (2, 4, 4, 7, 7, 16),
    (1, 8, 2, 33, 17, 64),
    (3, 6, 3, 20, 45, 32),
    (1, 4, 1, 130, 130, 24),
]

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def impl(name: str) -> AttentionImpl:
    """Build backend ``name``'s kernel with its default options."""
    return registry.get(name).make_impl()


REFERENCE = impl("reference")


def scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Return the scaled float64 scores ``(B, Hq, Sq, Sk)``, K heads broadcast for GQA."""
    groups = q.shape[-3] // k.shape[-3]
    kk = k.double().repeat_interleave(groups, dim=-3)
    return q.double() @ kk.transpose(-2, -1) / math.sqrt(q.shape[-1])


def window_mask(s: int, window: int, *, causal: bool) -> torch.Tensor:
    """Return the ``(S, S)`` boolean mask of keys within ``window`` of each query."""
    i = torch.arange(s).unsqueeze(1)
    j = torch.arange(s).unsqueeze(0)
    keep = (i - j).abs() <= window
    return keep & (j <= i) if causal else keep


class TestAgainstReference:
    """Dense backends agree with the plain-math reference computed in float64."""

    @pytest.mark.parametrize(
        ("name", "causal"), [(n, False) for n in DENSE] + [(n, True) for n in CAUSAL]
    )
    @pytest.mark.parametrize("shape", SHAPES, ids=str)
    def test_forward_float64(
        self, name: str, shape: Shape, causal: bool, inputs: RandomInputs
    ) -> None:
        """Forward (and the causal entry, where a backend has it) matches the reference within
        the float64 bound, GQA and cross lengths too."""
        q, k, v = inputs.qkv(*shape, dtype=torch.float64)
        out = run_dense(impl(name), q, k, v, causal=causal)
        ref = run_dense(REFERENCE, q, k, v, causal=causal)
        assert out.shape == q.shape
        assert rel_err(out, ref) < TOLERANCE[torch.float64], f"seed {inputs.seed}"

    @pytest.mark.parametrize("name", DENSE)
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
    def test_forward_low_precision(
        self, name: str, dtype: torch.dtype, inputs: RandomInputs
    ) -> None:
        """Low-precision forward stays within the stated bound of the float64 reference."""
        q, k, v = inputs.qkv(2, 8, 2, 40, 40, 32, dtype=dtype)
        out = impl(name).forward(q, k, v, scale=None)
        ref = REFERENCE.forward(q.double(), k.double(), v.double(), scale=None)
        assert out.dtype == dtype
        assert rel_err(out, ref) < TOLERANCE[dtype], f"seed {inputs.seed}"

    @pytest.mark.parametrize("name", DENSE)
    def test_custom_scale(self, name: str, inputs: RandomInputs) -> None:
        """An explicit softmax scale is honoured, not replaced by 1/sqrt(D)."""
        q, k, v = inputs.qkv(1, 2, 2, 9, 9, 16, dtype=torch.float64)
        out = impl(name).forward(q, k, v, scale=0.7)
        ref = REFERENCE.forward(q, k, v, scale=0.7)
        assert rel_err(out, ref) < TOLERANCE[torch.float64], f"seed {inputs.seed}"

    @pytest.mark.parametrize("name", MASKED)
    @pytest.mark.parametrize("kind", ["bool", "additive"])
    def test_masked(self, name: str, kind: str, inputs: RandomInputs) -> None:
        """Boolean and additive masks (broadcast over heads) match the reference."""
        q, k, v = inputs.qkv(2, 4, 2, 12, 12, 16, dtype=torch.float64)
        keep = inputs.keep_mask(2, 1, 12, 12)
        mask = keep if kind == "bool" else inputs.tensor(2, 1, 12, 12).masked_fill(~keep, -math.inf)
        out = impl(name).forward_masked(q, k, v, mask, scale=None)
        ref = REFERENCE.forward_masked(q, k, v, mask, scale=None)
        assert rel_err(out, ref) < TOLERANCE[torch.float64], f"seed {inputs.seed}"

    @pytest.mark.parametrize("name", MASKED)
    @pytest.mark.parametrize("shape", [(9,), (6, 9), (2, 1, 1, 9), (4, 6, 9)], ids=str)
    def test_mask_broadcasts(self, name: str, shape: tuple[int, ...], inputs: RandomInputs) -> None:
        """A mask of any shape broadcastable to (B, Hq, Sq, Sk) is accepted."""
        q, k, v = inputs.qkv(2, 4, 2, 6, 9, 8, dtype=torch.float64)
        keep = inputs.keep_mask(*shape)
        out = impl(name).forward_masked(q, k, v, keep, scale=None)
        ref = REFERENCE.forward_masked(q, k, v, keep, scale=None)
        assert rel_err(out, ref) < TOLERANCE[torch.float64], f"seed {inputs.seed}"

    @pytest.mark.parametrize("name", BIASED)
    @pytest.mark.parametrize("shape", [(9, 9), (1, 4, 12, 12), (2, 4, 12, 12)], ids=str)
    @pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
    def test_biased(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, inputs: RandomInputs
    ) -> None:
        """A float bias of any broadcastable shape is added to the scores as the reference does."""
        q, k, v = inputs.qkv(2, 4, 2, 9 if len(shape) == 2 else 12, shape[-1], 16, dtype=dtype)
        bias = 3 * inputs.tensor(*shape, dtype=dtype)  # large enough to change the softmax
        out = impl(name).forward_biased(q, k, v, bias, scale=1.0)
        ref = REFERENCE.forward_biased(q.double(), k.double(), v.double(), bias.double(), scale=1.0)
        assert out.dtype == dtype
        assert rel_err(out, ref) < TOLERANCE[dtype], f"seed {inputs.seed}"
        unbiased = REFERENCE.forward(q.double(), k.double(), v.double(), scale=1.0)
        assert rel_err(unbiased, ref) > 1e-2  # the bias mattered

    @pytest.mark.parametrize("name", BIASED)
    def test_bias_with_padding_folded_in(self, name: str, inputs: RandomInputs) -> None:
        """A padding mask folded into the bias as -inf hides those keys, as T5 needs."""
        q, k, v = inputs.qkv(2, 4, 4, 10, 10, 8, dtype=torch.float64)
        keep = torch.ones(2, 1, 1, 10, dtype=torch.bool)
        keep[1, ..., 6:] = False
        bias = inputs.tensor(1, 4, 10, 10).masked_fill(~keep, -math.inf)  # (2, 4, 10, 10)
        out = impl(name).forward_biased(q, k, v, bias, scale=None)
        short = REFERENCE.forward_biased(
            q[1:], k[1:, :, :6], v[1:, :, :6], bias[1:, :, :, :6], scale=None
        )
        assert rel_err(out[1:], short) < TOLERANCE[torch.float64], f"seed {inputs.seed}"

    @pytest.mark.parametrize("name", LSE)
    @pytest.mark.parametrize("shape", SHAPES, ids=str)
    def test_lse_is_logsumexp_of_scores(
        self, name: str, shape: Shape, inputs: RandomInputs
    ) -> None:
        """The returned LSE equals torch.logsumexp of the scaled scores."""
        q, k, v = inputs.qkv(*shape, dtype=torch.float64)
        out, lse = impl(name).forward_with_lse(q, k, v, is_causal=False, scale=None)
        expected = torch.logsumexp(scores(q, k), dim=-1)
        assert lse.shape == q.shape[:-1]
        assert rel_err(lse, expected) < TOLERANCE[torch.float64], f"seed {inputs.seed}"
        ref = REFERENCE.forward(q, k, v, scale=None)
        assert rel_err(out, ref) < TOLERANCE[torch.float64], f"seed {inputs.seed}"

    @pytest.mark.parametrize(
        ("name", "causal"),
        [(n, False) for n in VARLEN] + [(n, True) for n in VARLEN if n in CAUSAL],
    )
    def test_varlen_equals_per_sequence(
        self, name: str, causal: bool, inputs: RandomInputs
    ) -> None:
        """A packed batch gives each sequence exactly its own dense result."""
        lengths_q, lengths_k = [5, 1, 17, 9], [5, 3, 17, 12]
        if causal:
            lengths_k = lengths_q
        q = inputs.tensor(sum(lengths_q), 4, 16)  # (Tq, Hq, D)
        k = inputs.tensor(sum(lengths_k), 2, 16)  # (Tk, Hk, D)
        v = inputs.tensor(sum(lengths_k), 2, 16)
        cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
        cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
        out = impl(name).forward_varlen(
            q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), is_causal=causal, scale=None
        )
        for i in range(len(lengths_q)):
            qs = q[cu_q[i] : cu_q[i + 1]].transpose(0, 1).unsqueeze(0)  # (1, Hq, S_i, D)
            ks = k[cu_k[i] : cu_k[i + 1]].transpose(0, 1).unsqueeze(0)
            vs = v[cu_k[i] : cu_k[i + 1]].transpose(0, 1).unsqueeze(0)
            ref = run_dense(REFERENCE, qs, ks, vs, causal=causal)[0].transpose(0, 1)
            got = out[cu_q[i] : cu_q[i + 1]]
            assert rel_err(got, ref) < TOLERANCE[torch.float64], f"seq {i}, seed {inputs.seed}"


class TestTorchSdpa:
    """torch_sdpa wraps SDPA and claims nothing SDPA does not do."""

    def test_overrides_neither_varlen_nor_lse(self) -> None:
        """Its implementation defines neither forward_varlen nor forward_with_lse."""
        impl_cls = registry.get("torch_sdpa").impl_cls
        assert "forward_varlen" not in vars(impl_cls)
        assert "forward_with_lse" not in vars(impl_cls)
        assert impl_cls.forward_varlen is AttentionImpl.forward_varlen
        assert impl_cls.forward_with_lse is AttentionImpl.forward_with_lse

    def test_missing_capability_raises(self, inputs: RandomInputs) -> None:
        """Calling an LSE it does not have raises instead of computing something else."""
        q, k, v = inputs.qkv(1, 1, 1, 3, 3, 4, dtype=torch.float32)
        with pytest.raises(NotImplementedError, match="does not implement softmax LSE"):
            impl("torch_sdpa").forward_with_lse(q, k, v, is_causal=False, scale=None)


class TestTorchFlash:
    """torch_flash runs torch's fused kernel and returns its LSE."""

    def test_fully_masked_row_gives_zeros(self, inputs: RandomInputs) -> None:
        """A query whose keys are all masked out gets zeros, like the reference."""
        q, k, v = inputs.qkv(1, 2, 2, 4, 6, 8, dtype=torch.float64)
        keep = torch.ones(4, 6, dtype=torch.bool)
        keep[2] = False
        out = impl("torch_flash").forward_masked(q, k, v, keep, scale=None)
        ref = REFERENCE.forward_masked(q, k, v, keep, scale=None)
        assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
        assert rel_err(out, ref) < TOLERANCE[torch.float64], f"seed {inputs.seed}"

    def test_lse_is_float32_for_bfloat16(self, inputs: RandomInputs) -> None:
        """The LSE of bfloat16 inputs comes back in float32, close to the exact one."""
        q, k, v = inputs.qkv(1, 4, 4, 16, 16, 32, dtype=torch.bfloat16)
        _, lse = impl("torch_flash").forward_with_lse(q, k, v, is_causal=False, scale=None)
        assert lse.dtype == torch.float32
        assert rel_err(lse, torch.logsumexp(scores(q, k), dim=-1)) < TOLERANCE[torch.bfloat16]

    def test_varlen_spends_no_flops_on_padding(self, inputs: RandomInputs) -> None:
        """Packed attention costs the sum of per-sequence FLOPs, not the padded batch's."""
        lengths = [64, 300, 17, 200]
        q = inputs.tensor(sum(lengths), 4, 32, dtype=torch.float32)  # (T, H, D)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        with count_attention_flops() as counter:
            impl("torch_flash").forward_varlen(
                q, q, q, cu, cu, max(lengths), max(lengths), is_causal=False, scale=None
            )
        exact = sum(4 * 4 * n * n * 32 for n in lengths)
        padded = 4 * len(lengths) * 4 * max(lengths) ** 2 * 32
        assert counter.get_total_flops() == exact
        assert exact < padded / 2

    def test_mismatched_boundaries_are_refused(self, inputs: RandomInputs) -> None:
        """Boundaries that disagree with the packed length raise with the fix named."""
        q = inputs.tensor(10, 2, 8)
        good = torch.tensor([0, 4, 10])
        with pytest.raises(ValueError, match=r"cu_seqlens_k must run from 0 to 10"):
            impl("torch_flash").forward_varlen(
                q, q, q, good, torch.tensor([0, 4, 9]), 6, 6, is_causal=False, scale=None
            )
        with pytest.raises(ValueError, match="describes 2 sequences but cu_seqlens_k 1"):
            impl("torch_flash").forward_varlen(
                q, q, q, good, torch.tensor([0, 10]), 6, 10, is_causal=False, scale=None
            )

    @cuda
    @pytest.mark.cuda
    def test_cuda_matches_reference(self, inputs: RandomInputs) -> None:
        """On CUDA the efficient kernel's output and LSE match the reference."""
        q, k, v = (t.cuda() for t in inputs.qkv(2, 8, 2, 50, 70, 64, dtype=torch.float32))
        out, lse = impl("torch_flash").forward_with_lse(q, k, v, is_causal=False, scale=None)
        ref, ref_lse = REFERENCE.forward_with_lse(
            q.double(), k.double(), v.double(), is_causal=False, scale=None
        )
        # GPU kernels split their sums differently; the CPU float32 bound is not theirs.
        assert rel_err(out, ref) < 1e-4
        assert rel_err(lse, ref_lse) < 1e-4


class TestReference:
    """The reference is plain math with every capability, and never chosen automatically."""

    def test_fully_masked_row_is_zero_with_lse_minus_inf(self, inputs: RandomInputs) -> None:
        """A query that sees no key gets zeros, and its LSE is -inf (an empty sum)."""
        q, k, v = inputs.qkv(1, 1, 1, 3, 4, 8, dtype=torch.float64)
        keep = torch.ones(3, 4, dtype=torch.bool)
        keep[1] = False
        out = REFERENCE.forward_masked(q, k, v, keep, scale=None)
        assert torch.equal(out[0, 0, 1], torch.zeros(8, dtype=torch.float64))
        assert not out.isnan().any()

    def test_is_not_automatic(self) -> None:
        """It is marked to stay out of every fallback chain."""
        assert registry.get("reference").is_automatic is False

    def test_low_precision_inputs_compute_in_float32(self, inputs: RandomInputs) -> None:
        """bfloat16 inputs are computed in float32 and the LSE is float32."""
        q, k, v = inputs.qkv(1, 2, 2, 5, 5, 8, dtype=torch.bfloat16)
        out, lse = REFERENCE.forward_with_lse(q, k, v, is_causal=False, scale=None)
        assert out.dtype == torch.bfloat16
        assert lse.dtype == torch.float32


class TestSlidingWindow:
    """sliding_window is local attention, exact inside the window, linear in S."""

    @pytest.mark.parametrize(
        ("window", "s", "causal", "hk"),
        [
            (3, 17, False, 2),
            (3, 17, True, 4),
            (1, 9, True, 1),
            (5, 40, False, 4),
            (130, 600, True, 2),
        ],
    )
    def test_equals_reference_with_window_mask(
        self, window: int, s: int, causal: bool, hk: int, inputs: RandomInputs
    ) -> None:
        """It equals the reference under the window mask, GQA and causal included."""
        q, k, v = inputs.qkv(2, 4, hk, s, s, 16, dtype=torch.float64)
        kernel = registry.get("sliding_window").make_impl(SlidingWindowOptions(window=window))
        out = run_dense(kernel, q, k, v, causal=causal)
        ref = REFERENCE.forward_masked(q, k, v, window_mask(s, window, causal=causal), scale=None)
        assert rel_err(out, ref) < TOLERANCE[torch.float64], f"seed {inputs.seed}"

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    def test_low_precision(self, dtype: torch.dtype, inputs: RandomInputs) -> None:
        """Low-precision results stay within the stated bound of the float64 reference."""
        q, k, v = inputs.qkv(1, 4, 2, 300, 300, 32, dtype=dtype)
        kernel = registry.get("sliding_window").make_impl(SlidingWindowOptions(window=20))
        out = kernel.forward_causal(q, k, v, scale=None)
        ref = REFERENCE.forward_masked(
            q.double(), k.double(), v.double(), window_mask(300, 20, causal=True), scale=None
        )
        assert out.dtype == dtype
        assert rel_err(out, ref) < TOLERANCE[dtype], f"seed {inputs.seed}"

    def test_window_covering_everything_is_dense(self, inputs: RandomInputs) -> None:
        """A window at least S - 1 wide is exactly dense attention."""
        q, k, v = inputs.qkv(1, 2, 2, 16, 16, 8, dtype=torch.float64)
        kernel = registry.get("sliding_window").make_impl(SlidingWindowOptions(window=15))
        ref = REFERENCE.forward(q, k, v, scale=None)
        assert rel_err(kernel.forward(q, k, v, scale=None), ref) < TOLERANCE[torch.float64]

    def test_flops_grow_linearly_in_s(self, inputs: RandomInputs) -> None:
        """At a fixed window, doubling S doubles the kernel FLOPs (S·W, not S²)."""
        kernel = registry.get("sliding_window").make_impl(SlidingWindowOptions(window=64))
        flops = []
        for s in (2048, 4096, 8192):
            q = inputs.tensor(1, 2, s, 16, dtype=torch.float32)
            with count_attention_flops() as counter:
                kernel.forward(q, q, q, scale=None)
            flops.append(counter.get_total_flops())
        assert flops[1] == 2 * flops[0]
        assert flops[2] == 2 * flops[1]
        assert flops[2] < 8192**2 * 2 * 16 * 4 / 16  # far below dense S² attention

    def test_runs_where_s_squared_cannot_exist(self, inputs: RandomInputs) -> None:
        """At S = 2^19 (an S x S float32 score matrix would be 1 TiB) it runs and is exact."""
        s, window = 2**19, 4
        q = inputs.tensor(1, 1, s, 8, dtype=torch.float32)
        kernel = registry.get("sliding_window").make_impl(SlidingWindowOptions(window=window))
        out = kernel.forward(q, q, q, scale=None)
        for i in (0, 1, s // 2 + 3, s - 1):
            lo, hi = max(0, i - window), min(s, i + window + 1)
            local = q[:, :, lo:hi]
            ref = REFERENCE.forward(q[:, :, i : i + 1], local, local, scale=None)
            assert rel_err(out[:, :, i : i + 1], ref) < TOLERANCE[torch.float32], f"row {i}"

    def test_refuses_unequal_lengths(self, inputs: RandomInputs) -> None:
        """A window is a self-attention notion: different query and key lengths raise."""
        q, k, v = inputs.qkv(1, 1, 1, 4, 6, 8, dtype=torch.float32)
        with pytest.raises(ValueError, match="needs as many keys as queries"):
            registry.get("sliding_window").make_impl().forward(q, k, v, scale=None)


class TestFlashAttn:
    """flash_attn is optional: unavailable here with a reason, real where CUDA has it."""

    def test_unavailable_on_cpu_with_reason(self, cpu: Platform) -> None:
        """On a CPU platform it says it needs a CUDA device."""
        assert cpu.unavailable_reason("flash_attn") == (
            "flash_attn needs a CUDA device, this platform is cpu"
        )

    @cuda
    @pytest.mark.cuda
    def test_cuda_matches_reference(self, inputs: RandomInputs) -> None:
        """Where flash_attn imports, dense, LSE and varlen results match the reference."""
        reason = Platform("cuda").unavailable_reason("flash_attn")
        if reason is not None:
            pytest.skip(reason)
        q, k, v = (t.cuda() for t in inputs.qkv(2, 8, 2, 64, 64, 64, dtype=torch.bfloat16))
        kernel = impl("flash_attn")
        out, lse = kernel.forward_with_lse(q, k, v, is_causal=True, scale=None)
        ref, ref_lse = REFERENCE.forward_with_lse(q, k, v, is_causal=True, scale=None)
        assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]
        assert rel_err(lse, ref_lse) < 1e-3
        packed = q[0].transpose(0, 1).contiguous()  # (S, Hq, D)
        packed_k = k[0].transpose(0, 1).contiguous()
        packed_v = v[0].transpose(0, 1).contiguous()
        cu = torch.tensor([0, 20, 64], device="cuda")
        got = kernel.forward_varlen(
            packed, packed_k, packed_v, cu, cu, 44, 44, is_causal=False, scale=None
        )
        want = impl("torch_flash").forward_varlen(
            packed, packed_k, packed_v, cu, cu, 44, 44, is_causal=False, scale=None
        )
        assert rel_err(got, want) < TOLERANCE[torch.bfloat16]

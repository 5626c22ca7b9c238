"""A folder's tokenizers give every caller its own lengths, whatever runs beside it."""

from __future__ import annotations

import threading
from collections.abc import Callable

from components.folders.text import TextEncoderLoader
from components.recipes.folder import FolderPipeline
from tests.conftest import PipelineFolders

ROUNDS = 400


class TestTokenizerThreads:
    def test_concurrent_calls_keep_their_own_padding_and_truncation(
        self, pipeline_folder: PipelineFolders
    ) -> None:
        """Two threads tokenising at once with different lengths each get their own shapes.

        A fast tokenizer sets padding and truncation on its shared Rust object at every
        call, so without a lock one call could run with the other's (two SD3 requests of
        a worker encoding at once met a (1, 21) batch where (1, 77) was due).
        """
        loader = FolderPipeline.read(pipeline_folder("sd3")).loaders()["text_encoder"]
        assert isinstance(loader, TextEncoderLoader)
        wrong: list[str] = []

        def padded() -> None:
            for _ in range(ROUNDS):
                shape = tuple(loader.tokenize(["a red cat on the blue mat"], 77).ids.shape)
                if shape != (1, 77):
                    wrong.append(f"tokenize: {shape}")

        def cut() -> None:
            for _ in range(ROUNDS):
                if loader.truncated(["a red cat", "a"], 5) != [False, False]:
                    wrong.append("truncated")

        run_together(padded, cut)
        assert wrong == []


def run_together(*work: Callable[[], None]) -> None:
    """Run each of ``work`` on a thread of its own, all at once, and wait for them."""
    threads = [threading.Thread(target=job) for job in work]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

"""tiny_text_encoder's word tokenizer: prompts matter, and alike whatever shares the batch."""

from __future__ import annotations

import torch

from components.kinds.tiny_text_encoder import TinyTextEncoderOptions, prompt_inputs


class TestPromptInputs:
    def test_a_prompt_tokenises_alike_in_any_batch(self) -> None:
        """A prompt's real tokens do not depend on the other prompts of its batch."""
        options = TinyTextEncoderOptions()
        alone = prompt_inputs(options, ["a red fox"])
        together = prompt_inputs(options, ["ramen at night under neon", "a red fox"])
        assert torch.equal(together.tokens[1][together.mask[1]], alone.tokens[0][alone.mask[0]])
        assert together.mask.sum(dim=1).tolist() == [5, 3]

    def test_words_map_into_the_vocabulary_and_are_cut_at_max_len(self) -> None:
        """Ids stay below vocab_size; words past max_len are dropped; '' is one token."""
        options = TinyTextEncoderOptions(vocab_size=7, max_len=4)
        inputs = prompt_inputs(options, ["one two three four five six", ""])
        assert inputs.tokens.shape == (2, 4)
        assert int(inputs.tokens.max()) < 7
        assert inputs.mask.sum(dim=1).tolist() == [4, 1]

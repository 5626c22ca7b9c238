"""What an attention layer needs from its backend, as one frozen Struct."""

from __future__ import annotations

import msgspec


class AttentionRequirements(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Declare the capabilities an attention layer needs from its kernel.

    Attributes:
        packed_varlen: the layer calls ``forward_varlen`` on packed sequences.
        softmax_lse: the layer needs the softmax log-sum-exp (ring attention merges with it).
        attention_mask: the layer passes ``attn_mask`` to ``forward``.
    """

    packed_varlen: bool = False
    softmax_lse: bool = False
    attention_mask: bool = False

    def words(self) -> tuple[str, ...]:
        """Name each required capability in words a message can use."""
        return tuple(
            word
            for needed, word in (
                (self.packed_varlen, "packed varlen attention"),
                (self.softmax_lse, "softmax LSE"),
                (self.attention_mask, "attention masks"),
            )
            if needed
        )


NO_REQUIREMENTS = AttentionRequirements()

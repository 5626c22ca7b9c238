"""What an attention layer needs from its backend, as one frozen Struct."""

from __future__ import annotations

import msgspec

__all__ = ["NO_REQUIREMENTS", "AttentionRequirements"]


class AttentionRequirements(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Declare the capabilities an attention layer needs from its kernel.

    Attributes:
        packed_varlen: the layer calls ``forward_varlen`` on packed sequences.
        softmax_lse: the layer needs the softmax log-sum-exp (ring attention merges with it).
        attention_mask: the layer passes ``attn_mask`` to ``forward``.
        additive_bias: the layer adds a float bias to the scores (T5's learned relative
            position bias), passed as ``bias`` to ``forward``.
        causal: the layer attends causally (``is_causal``), through the kernel's causal
            mode rather than a mask it would have to build.
    """

    packed_varlen: bool = False
    softmax_lse: bool = False
    attention_mask: bool = False
    additive_bias: bool = False
    causal: bool = False

    def words(self) -> tuple[str, ...]:
        """Name each required capability in words a message can use."""
        return tuple(
            word
            for needed, word in (
                (self.packed_varlen, "packed varlen attention"),
                (self.softmax_lse, "softmax LSE"),
                (self.attention_mask, "attention masks"),
                (self.additive_bias, "an additive attention bias"),
                (self.causal, "causal attention"),
            )
            if needed
        )


NO_REQUIREMENTS = AttentionRequirements()

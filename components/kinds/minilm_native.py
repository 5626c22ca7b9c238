"""The native path of ``minilm_text_encoder``: transformers' ``BertModel``, unchanged inside.

Imported only when the native path is built, so that transformers stays optional: the
custom path never imports this module.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import BertConfig, BertModel

__all__ = ["NativeMiniLm"]

# B batch, S seq, E model width


class NativeMiniLm(BertModel):  # type: ignore[no-untyped-call]
    """transformers' ``BertModel``, called and named like the custom ``MiniLmEncoder``.

    Its state dict is the checkpoint's, so ``load_weights`` fills it from the shipped file
    strictly, as it does the custom encoder; ``forward`` takes the custom encoder's
    arguments, so the kind runs either path the same way.

    Args:
        config: the ``config.json`` file shipped with the weights.
    """

    def __init__(self, config: Path) -> None:
        super().__init__(BertConfig.from_json_file(str(config)))
        # The checkpoint stores the position ids, which transformers keeps out of the
        # state dict: make them persistent so the file loads with strict name matching.
        self.embeddings.register_buffer(
            "position_ids", self.embeddings.position_ids, persistent=True
        )

    @property
    def layers(self) -> nn.ModuleList:
        """The encoder layers, which layerwise offload streams (``encoder.layer``)."""
        layers: nn.ModuleList = self.encoder.layer
        return layers

    # The signature differs from BertModel's on purpose: it is the custom encoder's.
    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Encode ``tokens`` ``(B, S)`` int64 under ``mask`` ``(B, S)`` bool; ``(B, S, E)``."""
        out = super().forward(input_ids=tokens, attention_mask=mask)
        hidden: torch.Tensor = out.last_hidden_state  # (B, S, E)
        return hidden

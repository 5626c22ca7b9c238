"""Measure the language model encodes of Flux.2 klein and Z-Image: every layer vs the layers
up to the deepest hidden state read (issue 30).

Flux.2 klein reads Qwen3's hidden states 9, 18 and 27 (the inputs of those layers) and
Z-Image the penultimate one (the last layer's input); transformers' decoder runs every
layer anyway, as diffusers calls it. ``LlmTextEncoderLoader`` stops the decoder after the
deepest layer read (``stop_after``): 27 of Qwen3-4B's 36 layers for klein, 35 for Z-Image.
Both runs share one model of Qwen3-4B's real sizes (width 2560, feed-forward 9728, 32
query and 8 key-value heads of 128, 36 layers, a 151,936-token vocabulary), its weights
seeded, in bfloat16 (the checkpoints' dtype; float32 would take 16 GB), over one prompt in
the chat template padded to 512 tokens, as both pipelines pad it. They are timed side by
side in alternating rounds (order reversed every round), in CPU seconds of this process;
the table gives the median CPU-s of each, their ratio and whether the states read are
equal to the bit.

One intra-op thread, as in ``attention_overhead``: on a shared 2-core machine a second
OpenMP thread makes the timings noise.

Run: ``python -m benchmarks llm_layers``.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from benchmarks._llm_folders import FLUX2_TEXT_LAYERS, qwen_tokenizer
from benchmarks.attention_overhead import interleaved, threads
from benchmarks.make_pipeline import WORDS
from components.kinds.llm_text_encoder import STACKS, stop_after
from components.weights import seed_weights

QWEN3_4B = {
    "vocab_size": 151936,
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
"""Qwen3-4B's ``config.json`` sizes (the text encoder of Z-Image and Flux.2 klein 4B)."""
LENGTH = 512  # both pipelines' max_sequence_length
PROMPT = " ".join(WORDS[40:62])
ROUNDS = 3


def qwen3_4b() -> nn.Module:
    """Return a ``Qwen3ForCausalLM`` of Qwen3-4B's sizes in bfloat16, its weights seeded."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_4B)).to(torch.bfloat16)
    seed_weights(model, 0)
    return model.eval()


def sharing(model: nn.Module) -> nn.Module:
    """Return a copy of ``model`` (its modules, its config) that holds ``model``'s own
    weights: stopping the copy's decoder leaves ``model`` running every layer."""
    memo: dict[int, object] = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def states(
    decoder: nn.Module, ids: torch.Tensor, mask: torch.Tensor, read: Sequence[int]
) -> list[torch.Tensor]:
    """Return the hidden states ``read`` of one run of ``decoder``, as the pipelines read them."""
    output = decoder(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    return [output.hidden_states[layer] for layer in read]


def cpu_seconds(calls: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Return each call's median CPU seconds over ``ROUNDS`` rounds, timed side by side."""
    samples = interleaved(calls, rounds=ROUNDS, inner=1, clock=time.process_time)
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    """Print the table: one prompt's encode through every layer vs up to the deepest read."""
    tokenizer = qwen_tokenizer(WORDS)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
    )
    tokens = tokenizer([text], padding="max_length", max_length=LENGTH, return_tensors="pt")
    ids, mask = tokens.input_ids, tokens.attention_mask
    layers = QWEN3_4B["num_hidden_layers"]
    full = qwen3_4b()
    cases = {  # pipeline: (the hidden states it reads, the layers that make them)
        "Flux.2 klein": (FLUX2_TEXT_LAYERS, max(FLUX2_TEXT_LAYERS)),
        "Z-Image": ((layers - 1,), layers - 1),
    }
    print(f"Qwen3-4B sizes, bfloat16, one prompt of {int(mask.sum())} tokens padded to {LENGTH}")
    print(f"{'pipeline':<14}{'layers':>8}{'all CPU-s':>11}{'read CPU-s':>12}{'ratio':>8}  equal")
    with threads(1), torch.inference_mode():
        for name, (read, runs) in cases.items():
            stopped = sharing(full)
            stop_after(stopped, STACKS["Qwen3ForCausalLM"], runs)
            decoders = {"all": full.get_submodule("model"), "read": stopped.get_submodule("model")}
            calls: dict[str, Callable[[], object]] = {
                key: lambda d=decoder, r=read: states(d, ids, mask, r)
                for key, decoder in decoders.items()
            }
            seconds = cpu_seconds(calls)
            equal = all(map(torch.equal, *(states(d, ids, mask, read) for d in decoders.values())))
            print(
                f"{name:<14}{f'{runs}/{layers}':>8}{seconds['all']:>11.3f}{seconds['read']:>12.3f}"
                f"{seconds['read'] / seconds['all']:>8.3f}  {equal}"
            )

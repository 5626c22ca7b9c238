"""The pipelines whose text encoder is a language model: Qwen-Image, Z-Image, Flux.2 klein.

Their tokenizer is Qwen's byte-level BPE (``Qwen2Tokenizer``), made here with no download:
merges are learnt by ``tokenizers``' own trainer from a corpus of the prompt templates and
``make_pipeline.WORDS``, so every word of a template is one token, as it is in the real
vocabulary. That matters: Qwen-Image drops the first 34 tokens of its templated prompt,
which are exactly its system prompt when each of its words is one token; a vocabulary
that split them into pieces would drop the system prompt's first pieces only and keep
the rest, and a real prompt would reach the DiT behind the leftover (with bytes alone it
would not reach it at all). Z-Image and Flux.2 klein template through the tokenizer's
chat template (Qwen3's, for a conversation of user messages), saved with it.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import Qwen2Tokenizer

    from benchmarks.make_pipeline import Dims

QWEN_IMAGE_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
"""diffusers' ``QwenImagePipeline.prompt_template_encode``: its first 34 tokens are dropped."""
QWEN_SPECIAL = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<think>",
    "</think>",
)
"""Qwen's special tokens, ids 0 to 8 here (Qwen2.5-VL's config names the vision ones)."""
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)
"""Qwen3's chat template, as it renders a conversation of user messages (what Z-Image and
Flux.2 klein send): a thinking block only when thinking is turned off."""
VOCAB_SIZE = 1024
"""Tokens the trainer may make (it stops once every word of the corpus is one token)."""
FLUX2_TEXT_LAYERS = (9, 18, 27)
"""The hidden states ``Flux2KleinPipeline`` stacks by default: its encoder needs 28 layers."""


def qwen_tokenizer(words: tuple[str, ...]) -> Qwen2Tokenizer:
    """Return a Qwen byte-level BPE tokenizer whose merges were learnt from the templates and
    ``words``, with Qwen's special tokens and Qwen3's chat template."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    prompt = " ".join(words)
    corpus = [
        QWEN_IMAGE_TEMPLATE.format(prompt),
        "<|im_start|>user\n" + prompt + "<|im_end|>\n<|im_start|>assistant\n",
        prompt.capitalize(),
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any text tokenizes
        special_tokens=list(QWEN_SPECIAL),
        show_progress=False,
    )
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.Sequence(  # Qwen2Tokenizer's own
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    learner.train_from_iterator(corpus, trainer)
    model = json.loads(learner.to_str())["model"]
    tokenizer = Qwen2Tokenizer(
        vocab=model["vocab"],
        merges=[tuple(pair) for pair in model["merges"]],
        model_max_length=131072,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL[1:])})
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


def special_id(tokenizer: Qwen2Tokenizer, token: str) -> int:
    """Return the id of ``token``, one of ``QWEN_SPECIAL``."""
    found: int = tokenizer.convert_tokens_to_ids(token)
    return found


def qwen2_5_vl(dims: Dims, tokenizer: Qwen2Tokenizer) -> Any:
    """Return a Qwen2.5-VL whose text model is ``dims.text`` wide (a 2-block vision tower)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    head_dim = 16
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": dims.text,
            "intermediate_size": dims.text * 2,
            "num_hidden_layers": dims.text_layers,
            "num_attention_heads": dims.text // head_dim,
            "num_key_value_heads": dims.text // head_dim // 2,  # grouped-query, as the real one
            "rope_scaling": {"mrope_section": [2, 3, 3], "rope_type": "default", "type": "default"},
            "rope_theta": 1000000.0,
            "max_position_embeddings": 4096,
            "bos_token_id": special_id(tokenizer, "<|endoftext|>"),
            "eos_token_id": special_id(tokenizer, "<|im_end|>"),
        },
        vision_config={
            "depth": 2,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": dims.text,
        },
        image_token_id=special_id(tokenizer, "<|image_pad|>"),
        video_token_id=special_id(tokenizer, "<|video_pad|>"),
        vision_start_token_id=special_id(tokenizer, "<|vision_start|>"),
        vision_end_token_id=special_id(tokenizer, "<|vision_end|>"),
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def qwen3_config(dims: Dims, tokenizer: Qwen2Tokenizer, layers: int) -> Any:
    """Return a Qwen3 configuration ``dims.text`` wide with ``layers`` layers."""
    from transformers import Qwen3Config

    head_dim = 16
    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=dims.text,
        intermediate_size=dims.text * 2,
        num_hidden_layers=layers,
        num_attention_heads=dims.text // head_dim,
        num_key_value_heads=dims.text // head_dim // 2,
        head_dim=head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=special_id(tokenizer, "<|endoftext|>"),
        eos_token_id=special_id(tokenizer, "<|im_end|>"),
    )


def qwen_image(dims: Dims, words: tuple[str, ...]) -> tuple[type, dict[str, Any]]:
    """Return Qwen-Image's pipeline class and components (Qwen2.5-VL, MMDiT, its own VAE)."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )

    tokenizer = qwen_tokenizer(words)
    z_dim = 4
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=z_dim * 4,
        out_channels=z_dim,
        num_layers=dims.layers,
        attention_head_dim=dims.head_dim,
        num_attention_heads=dims.heads,
        joint_attention_dim=dims.text,
        axes_dims_rope=(dims.head_dim // 4, dims.head_dim * 3 // 8, dims.head_dim * 3 // 8),
    )
    vae = AutoencoderKLQwenImage(
        base_dim=dims.vae[0],
        z_dim=z_dim,
        dim_mult=[1, 2, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.1, -0.2, 0.05, 0.3],  # not the identity: the recipe must apply them
        latents_std=[1.5, 0.8, 1.2, 2.0],
    )
    scheduler = FlowMatchEulerDiscreteScheduler(  # Qwen-Image's own settings
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=8192,
        max_shift=0.9,
        shift=1.0,
        shift_terminal=0.02,
        use_dynamic_shifting=True,
        time_shift_type="exponential",
    )
    components = {
        "transformer": transformer,
        "vae": vae,
        "scheduler": scheduler,
        "text_encoder": qwen2_5_vl(dims, tokenizer),
        "tokenizer": tokenizer,
    }
    return QwenImagePipeline, components


def z_image(dims: Dims, words: tuple[str, ...]) -> tuple[type, dict[str, Any]]:
    """Return Z-Image's pipeline class and components (Qwen3, its DiT, an ``AutoencoderKL``)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Model

    from benchmarks.make_pipeline import vae

    tokenizer = qwen_tokenizer(words)
    width = dims.heads * dims.head_dim
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=16,
        dim=width,
        n_layers=dims.layers,
        n_refiner_layers=1,
        n_heads=dims.heads,
        n_kv_heads=dims.heads,
        norm_eps=1e-5,
        qk_norm=True,
        cap_feat_dim=dims.text,
        rope_theta=256.0,
        t_scale=1000.0,
        axes_dims=[dims.head_dim // 2, dims.head_dim // 4, dims.head_dim // 4],
        axes_lens=[1024, 64, 64],
    )
    components = {
        "transformer": transformer,
        "vae": vae(dims, 16, flow=True, factors=(0.3611, 0.1159)),
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0),  # Z-Image-Turbo's
        "text_encoder": Qwen3Model(qwen3_config(dims, tokenizer, dims.text_layers)),
        "tokenizer": tokenizer,
    }
    return ZImagePipeline, components


def flux2_klein(
    dims: Dims, words: tuple[str, ...], *, distilled: bool
) -> tuple[type, dict[str, Any]]:
    """Return Flux.2 klein's pipeline class and components (Qwen3 LM, its DiT, its VAE)."""
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )
    from transformers import Qwen3ForCausalLM

    tokenizer = qwen_tokenizer(words)
    latent_channels = 4
    head_dim = dims.head_dim
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=latent_channels * 4,  # the VAE's latents patchified two by two
        num_layers=dims.layers // 2 or 1,
        num_single_layers=dims.layers,
        attention_head_dim=head_dim,
        num_attention_heads=dims.heads,
        joint_attention_dim=dims.text * len(FLUX2_TEXT_LAYERS),
        timestep_guidance_channels=256,
        axes_dims_rope=(head_dim // 4,) * 4,
        guidance_embeds=False,
    )
    blocks = len(dims.vae)
    vae = AutoencoderKLFlux2(
        sample_size=dims.sample * 2 ** (blocks - 1),
        down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks,
        block_out_channels=dims.vae,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=min(dims.vae[0], 32),
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(  # Flux.2 klein's own settings
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=4096,
        max_shift=1.15,
        shift=3.0,
        use_dynamic_shifting=True,
    )
    layers = max(FLUX2_TEXT_LAYERS) + 1
    components = {
        "scheduler": scheduler,
        "text_encoder": Qwen3ForCausalLM(qwen3_config(dims, tokenizer, layers)),
        "tokenizer": tokenizer,
        "transformer": transformer,
        "vae": vae,
        "is_distilled": distilled,
    }
    return Flux2KleinPipeline, components

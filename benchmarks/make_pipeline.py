"""Write a real diffusers-format pipeline folder with seeded random weights.

``python -m benchmarks.make_pipeline FAMILY DIR [--size tiny|bench] [--seed N]`` (FAMILY:
pixart, pixart-sigma, flux, sd3, qwen-image, z-image, flux2-klein, flux2-klein-distilled,
or the videos wan, wan-a14b, wan-ti2v, wan-i2v, wan-i2v-a14b) builds the pipeline from
diffusers' and transformers' own classes, fills every weight from the seed, and writes
it with diffusers' ``save_pretrained``: a ``model_index.json``, one subfolder per
component with ``config.json`` and safetensors weights, the scheduler's config and the
tokenizers. Nothing is downloaded: the
tokenizers are made here with the ``tokenizers`` library (a word-level vocabulary of
common words, split on whitespace and punctuation), one per text encoder, T5's closing
each prompt with ``</s>`` and CLIP's wrapping it in its start and end tokens; the
language-model encoders' byte-level BPE learns its merges here (``benchmarks._llm_folders``).

``tiny`` folders are for tests (a request takes a fraction of a second); ``bench``
folders are for benchmarks (a load and a request take a measurable second or so).
Needs the ``diffusers`` extra.

``--smooth-time`` makes adjacent denoising steps differ as a trained model's do, for the
tests and benchmarks of step caches (design §17). Seeded weights make every step look
new: the DiT's timestep MLP reads the fast sinusoid frequencies as strongly as the slow
ones, so its first block's output changes by 0.3-0.5 (relative L1) from one step to the
next and a first-block cache never skips. A trained timestep MLP leans on the slow
frequencies; zeroing its first layer's weights on the fastest half of them (the cosine
and the sine columns alike, ``smooth_time_embedding``) brings that change to what
trained models show, a few hundredths. Nothing else changes, so such a folder still
runs equal to diffusers.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, get_args

import torch

from benchmarks import _llm_folders
from benchmarks._progress import no_progress_bars
from components.weights import seed_weights

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

Size = Literal["tiny", "bench"]
Family = Literal[
    "pixart",
    "pixart-sigma",
    "flux",
    "sd3",
    "qwen-image",
    "z-image",
    "flux2-klein",
    "flux2-klein-distilled",
    "wan",
    "wan-a14b",
    "wan-ti2v",
    "wan-i2v",
    "wan-i2v-a14b",
]

T5_SPECIAL = ("<pad>", "</s>", "<unk>")
CLIP_SPECIAL = ("<|startoftext|>", "<|endoftext|>", "<unk>")
CLIP_MAX_TOKENS = 77
T5_MAX_TOKENS = 512
WORDS = (  # noqa: SIM905  (a list of 190 words reads better as text)
    ". , ! ? ' - a an the of on in at by to with and or under over above below near behind "
    "between across through into from for is are was sits stands runs flies leaps swims "
    "rides holds wears looks red orange yellow green blue purple pink brown black white "
    "grey golden silver dark bright soft small large tiny huge old young happy sad calm "
    "wild cat dog fox horse bird fish owl bear wolf lion tiger rabbit squirrel astronaut "
    "robot knight wizard child woman man person city town village forest river lake sea "
    "ocean beach mountain hill valley desert field garden park street road bridge tower "
    "castle house room window door table chair bowl cup book lamp car boat train ship sky "
    "cloud clouds sun moon star stars rain snow storm fog light shadow morning evening "
    "night dawn dusk sunset sunrise winter summer spring autumn painting photo photograph "
    "drawing sketch watercolour watercolor oil portrait landscape close-up view aerial "
    "studio lighting cinematic detailed realistic style art burger ramen egg coffee tea "
    "bread fruit apple flower flowers tree trees leaves grass stone glass metal wood fire "
    "water ice gold"
).split()


class Dims(NamedTuple):
    """The widths and depths of one size of folder.

    Attributes:
        text: the T5 encoder's width.
        text_layers: its layers.
        clip: the CLIP encoders' width (SD3's second one is twice as wide).
        clip_layers: their layers.
        heads: the DiT's attention heads.
        head_dim: each head's width.
        layers: the DiT's blocks (Flux: of each of its two stacks).
        vae: the VAE's block widths (the image is ``2 ** (len - 1)`` times the latents).
        sample: the DiT's default latent side.
        video: the video VAE's base width (Wan; its four stages all that wide).
        image: the image encoder's width (Wan 2.1 I2V's CLIP vision model) and side.
    """

    text: int
    text_layers: int
    clip: int
    clip_layers: int
    heads: int
    head_dim: int
    layers: int
    vae: tuple[int, ...]
    sample: int
    video: int
    image: int


DIMS: dict[Size, Dims] = {
    "tiny": Dims(
        text=64, text_layers=2, clip=16, clip_layers=2, heads=2, head_dim=16, layers=2,
        vae=(8, 8, 8, 8), sample=32, video=4, image=8,
    ),
    "bench": Dims(
        text=256, text_layers=6, clip=64, clip_layers=4, heads=6, head_dim=64, layers=8,
        vae=(32, 64, 64, 64), sample=32, video=16, image=32,
    ),
}  # fmt: skip


def vocabulary(special: tuple[str, ...]) -> dict[str, int]:
    """Return the word-level vocabulary: the special tokens first, then ``WORDS``."""
    return {token: index for index, token in enumerate((*special, *WORDS))}


def word_tokenizer(
    special: tuple[str, ...], template: str, max_tokens: int
) -> PreTrainedTokenizerFast:
    """Build a lower-casing word-level tokenizer whose post-processor applies ``template``.

    ``special`` is (padding or start, end, unknown); ``template`` places the end (and start)
    tokens around ``$A``.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = vocabulary(special)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=special[2]))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[(token, vocab[token]) for token in special[:2]]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=special[0] if special is T5_SPECIAL else special[1],
        eos_token=special[1],
        unk_token=special[2],
        **({} if special is T5_SPECIAL else {"bos_token": special[0]}),
        model_max_length=max_tokens,
    )


def t5(dims: Dims, *, umt5: bool = False) -> tuple[Any, PreTrainedTokenizerFast]:
    """Return a T5 encoder (v1.1 style: gated GELU, untied head), or with ``umt5`` a UMT5
    one (Wan's text encoder: a position bias in every layer), and its tokenizer."""
    import transformers

    prefix = "UMT5" if umt5 else "T5"
    config = getattr(transformers, f"{prefix}Config")(
        vocab_size=len(vocabulary(T5_SPECIAL)),
        d_model=dims.text,
        d_kv=dims.text // 4,
        d_ff=dims.text * 2 + 5,
        num_layers=dims.text_layers,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        pad_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    encoder = getattr(transformers, f"{prefix}EncoderModel")(config)
    return encoder, word_tokenizer(T5_SPECIAL, "$A </s>", T5_MAX_TOKENS)


def clip(dims: Dims, width: int, *, projection: bool) -> tuple[Any, PreTrainedTokenizerFast]:
    """Return a CLIP text encoder ``width`` wide (with a projection for SD3) and its tokenizer."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(vocabulary(CLIP_SPECIAL)),
        hidden_size=width,
        intermediate_size=width * 2 + 5,
        num_hidden_layers=dims.clip_layers,
        num_attention_heads=4,
        max_position_embeddings=CLIP_MAX_TOKENS,
        projection_dim=width * 2,
        hidden_act="gelu",
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    model = CLIPTextModelWithProjection(config) if projection else CLIPTextModel(config)
    template = "<|startoftext|> $A <|endoftext|>"
    return model, word_tokenizer(CLIP_SPECIAL, template, CLIP_MAX_TOKENS)


def vae(
    dims: Dims,
    latent_channels: int,
    *,
    flow: bool,
    factors: tuple[float, float] = (1.5035, 0.0609),
) -> Any:
    """Return an ``AutoencoderKL`` with ``dims.vae`` blocks (Flux and SD3: no quant convs, and
    the latents scaled and shifted by ``factors``)."""
    from diffusers import AutoencoderKL

    blocks = len(dims.vae)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks,
        block_out_channels=dims.vae,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=min(dims.vae[0], 32),
        sample_size=dims.sample * 2 ** (blocks - 1),
        use_quant_conv=not flow,
        use_post_quant_conv=not flow,
        **({"scaling_factor": factors[0], "shift_factor": factors[1]} if flow else {}),
    )


def pixart(dims: Dims, *, sigma: bool) -> tuple[type, dict[str, Any]]:
    """Return PixArt-alpha or -sigma's pipeline class and components (T5, DiT, VAE)."""
    from diffusers import (
        DPMSolverMultistepScheduler,
        PixArtAlphaPipeline,
        PixArtSigmaPipeline,
        PixArtTransformer2DModel,
    )

    text_encoder, tokenizer = t5(dims)
    transformer = PixArtTransformer2DModel(
        sample_size=dims.sample,
        num_layers=dims.layers,
        patch_size=2,
        attention_head_dim=dims.head_dim,
        num_attention_heads=dims.heads,
        caption_channels=dims.text,
        in_channels=4,
        out_channels=8,
        cross_attention_dim=dims.heads * dims.head_dim,
        use_additional_conditions=False if sigma else None,
    )
    components = {
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "transformer": transformer,
        "vae": vae(dims, 4, flow=False),
        "scheduler": DPMSolverMultistepScheduler(),
    }
    return (PixArtSigmaPipeline if sigma else PixArtAlphaPipeline), components


def flux(dims: Dims) -> tuple[type, dict[str, Any]]:
    """Return Flux's pipeline class and components (CLIP, T5, guidance-distilled DiT, VAE)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    text_encoder, tokenizer = clip(dims, dims.clip, projection=False)
    text_encoder_2, tokenizer_2 = t5(dims)
    head_dim = dims.head_dim
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=dims.layers,
        num_single_layers=dims.layers,
        attention_head_dim=head_dim,
        num_attention_heads=dims.heads,
        joint_attention_dim=dims.text,
        pooled_projection_dim=dims.clip,
        guidance_embeds=True,
        axes_dims_rope=(head_dim // 4, head_dim * 3 // 8, head_dim * 3 // 8),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    components = {
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "text_encoder_2": text_encoder_2,
        "tokenizer_2": tokenizer_2,
        "transformer": transformer,
        "vae": vae(dims, 4, flow=True),
        "scheduler": scheduler,
        "image_encoder": None,
        "feature_extractor": None,
    }
    return FluxPipeline, components


def sd3(dims: Dims) -> tuple[type, dict[str, Any]]:
    """Return SD3's pipeline class and components (two CLIP, T5, MMDiT, VAE)."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    text_encoder, tokenizer = clip(dims, dims.clip, projection=True)
    # twice as wide, as SD3's second CLIP is: the two together still fit inside T5's width
    text_encoder_2, tokenizer_2 = clip(dims, dims.clip * 2, projection=True)
    text_encoder_3, tokenizer_3 = t5(dims)
    transformer = SD3Transformer2DModel(
        sample_size=dims.sample,
        patch_size=2,
        in_channels=4,
        num_layers=dims.layers,
        attention_head_dim=dims.head_dim,
        num_attention_heads=dims.heads,
        joint_attention_dim=dims.text,
        caption_projection_dim=dims.heads * dims.head_dim,
        pooled_projection_dim=dims.clip * 2 + dims.clip * 4,
        out_channels=4,
        pos_embed_max_size=dims.sample * 2,
    )
    components = {
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "text_encoder_2": text_encoder_2,
        "tokenizer_2": tokenizer_2,
        "text_encoder_3": text_encoder_3,
        "tokenizer_3": tokenizer_3,
        "transformer": transformer,
        "vae": vae(dims, 4, flow=True),
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0),
        "image_encoder": None,
        "feature_extractor": None,
    }
    return StableDiffusion3Pipeline, components


WAN_BOUNDARY = {"wan-a14b": 0.875, "wan-i2v-a14b": 0.9}
"""Wan 2.2 A14B's boundary ratio per family: ``transformer`` runs the steps whose timestep
is at least this times 1000, ``transformer_2`` the rest (0.875 for text to video, 0.9 for
image to video, as the released folders say)."""


def wan_vae(dims: Dims, *, wide: bool) -> Any:
    """Return an ``AutoencoderKLWan``: 16 latent channels at 8x (Wan 2.1, A14B), or 48 at
    16x through a patch of 2 (``wide``: TI2V-5B)."""
    from diffusers import AutoencoderKLWan

    shared: dict[str, Any] = {
        "base_dim": dims.video,
        "dim_mult": [1, 1, 1, 1],
        "num_res_blocks": 1,
        "temperal_downsample": [False, True, True],
    }
    if not wide:
        return AutoencoderKLWan(z_dim=16, **shared)
    return AutoencoderKLWan(
        z_dim=48,
        in_channels=12,
        out_channels=12,
        is_residual=True,
        patch_size=2,
        latents_mean=[0.0] * 48,
        latents_std=[1.0] * 48,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        **shared,
    )


def wan_transformer(
    dims: Dims, channels: int, *, into: int | None = None, image_dim: int | None = None
) -> Any:
    """Return a ``WanTransformer3DModel`` predicting ``channels`` from ``into`` (the noise and,
    for image to video, the mask and the encoded image), cross-attending to the image
    encoder's ``image_dim`` states too where given (Wan 2.1 I2V)."""
    from diffusers import WanTransformer3DModel

    head_dim = 12 if dims.head_dim < 24 else 48  # a multiple of 6: the 3D rotary splits it
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=dims.heads,
        attention_head_dim=head_dim,
        in_channels=into or channels,
        out_channels=channels,
        text_dim=dims.text,
        freq_dim=256,
        ffn_dim=4 * dims.text,  # two experts outweigh UMT5: the largest stage holds one
        num_layers=dims.layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64,
        image_dim=image_dim,
        # Wan 2.1 I2V attends to the image states apart, through added K/V projections
        added_kv_proj_dim=None if image_dim is None else dims.heads * head_dim,
    )


def wan_scheduler() -> Any:
    """Return Wan's flow-matching UniPC scheduler (shift 3, the 480p setting)."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )


def wan(dims: Dims, family: Family) -> tuple[type, dict[str, Any]]:
    """Return ``WanPipeline``'s components: Wan 2.1 (one DiT), 2.2 A14B (two experts and a
    boundary) or 2.2 TI2V-5B (the wide VAE, a timestep per token)."""
    from diffusers import WanPipeline

    text_encoder, tokenizer = t5(dims, umt5=True)
    wide = family == "wan-ti2v"
    channels = 48 if wide else 16
    two = family == "wan-a14b"
    components = {
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "transformer": wan_transformer(dims, channels),
        "transformer_2": wan_transformer(dims, channels) if two else None,
        "vae": wan_vae(dims, wide=wide),
        "scheduler": wan_scheduler(),
        "boundary_ratio": WAN_BOUNDARY.get(family),
        "expand_timesteps": wide,
    }
    return WanPipeline, components


def wan_i2v(dims: Dims, family: Family) -> tuple[type, dict[str, Any]]:
    """Return ``WanImageToVideoPipeline``'s components: Wan 2.1 I2V (a CLIP image encoder
    whose states the DiT attends to) or 2.2 A14B I2V (two experts, no image encoder)."""
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    text_encoder, tokenizer = t5(dims, umt5=True)
    two = family == "wan-i2v-a14b"
    image_dim = None if two else dims.image
    into = 16 + 4 + 16  # noise, the first frame's mask (4 frames a latent), the image
    encoder = None
    processor = None
    if not two:
        config = CLIPVisionConfig(
            hidden_size=dims.image,
            projection_dim=dims.image,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            intermediate_size=dims.image * 4,
            patch_size=8,
        )
        encoder = CLIPVisionModel(config)
        processor = CLIPImageProcessor(crop_size=32, size=32)
    components = {
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "transformer": wan_transformer(dims, 16, into=into, image_dim=image_dim),
        "transformer_2": wan_transformer(dims, 16, into=into) if two else None,
        "vae": wan_vae(dims, wide=False),
        "scheduler": wan_scheduler(),
        "image_encoder": encoder,
        "image_processor": processor,
        "boundary_ratio": WAN_BOUNDARY.get(family),
    }
    return WanImageToVideoPipeline, components


BUILDERS: dict[Family, Callable[[Dims], tuple[type, dict[str, Any]]]] = {
    "pixart": lambda dims: pixart(dims, sigma=False),
    "pixart-sigma": lambda dims: pixart(dims, sigma=True),
    "flux": flux,
    "sd3": sd3,
    "qwen-image": lambda dims: _llm_folders.qwen_image(dims, WORDS),
    "z-image": lambda dims: _llm_folders.z_image(dims, WORDS),
    "flux2-klein": lambda dims: _llm_folders.flux2_klein(dims, WORDS, distilled=False),
    "flux2-klein-distilled": lambda dims: _llm_folders.flux2_klein(dims, WORDS, distilled=True),
    "wan": lambda dims: wan(dims, "wan"),
    "wan-a14b": lambda dims: wan(dims, "wan-a14b"),
    "wan-ti2v": lambda dims: wan(dims, "wan-ti2v"),
    "wan-i2v": lambda dims: wan_i2v(dims, "wan-i2v"),
    "wan-i2v-a14b": lambda dims: wan_i2v(dims, "wan-i2v-a14b"),
}


def positive_variances(module: torch.nn.Module) -> None:
    """Make the running variances of ``module``'s batch norms positive (Flux.2's VAE has one):
    seeded near zero, some would be negative, and their square root NaN."""
    with torch.no_grad():
        for layer in module.modules():
            if isinstance(layer, torch.nn.modules.batchnorm._BatchNorm):
                assert layer.running_var is not None
                layer.running_var.abs_().add_(0.5)


SEED_OFFSETS = {"transformer_2": 1}
"""Components seeded apart from their twin of the same class: Wan 2.2 A14B's second expert
is another model than its first (seeded alike, a hand-over would change nothing)."""

TIME_EMBEDDER = "timestep_embedder.linear_1"
"""The first layer of a DiT's timestep MLP (PixArt, Flux and SD3 name it alike)."""


def smooth_time_embedding(transformer: torch.nn.Module) -> None:
    """Zero the timestep MLP's first-layer weights on the fastest half of its frequencies.

    Every ``timestep_embedder.linear_1`` of ``transformer`` is smoothed (``smooth_frequencies``).
    """
    layers = [m for n, m in transformer.named_modules() if n.endswith(TIME_EMBEDDER)]
    if not layers:
        raise ValueError(f"{type(transformer).__name__} has no {TIME_EMBEDDER} to smooth")
    for layer in layers:
        assert isinstance(layer, torch.nn.Linear)
        smooth_frequencies(layer)


def smooth_frequencies(layer: torch.nn.Linear) -> None:
    """Zero ``layer``'s weights on the fastest half of the sinusoid frequencies it reads.

    The layer reads ``cos(t f_k)`` then ``sin(t f_k)`` for ``f_k = 10000^(-k/half)``, the
    fastest first: columns ``0 .. half/2`` and ``half .. half + half/2`` are zeroed.
    """
    half = layer.in_features // 2
    with torch.no_grad():
        layer.weight[:, : half // 2] = 0
        layer.weight[:, half : half + half // 2] = 0


@no_progress_bars()
def write_pipeline(
    family: Family,
    folder: Path,
    *,
    size: Size = "tiny",
    seed: int = 0,
    smooth_time: bool = False,
) -> Path:
    """Write the ``family`` pipeline of ``size`` into ``folder`` and return ``folder``.

    Every weight of every model is drawn from ``seed`` and its own name
    (``components.weights.seed_weights``), so a folder does not depend on the global
    random state; the same arguments write the same weights. ``smooth_time`` smooths the
    DiT's timestep embedding over steps (``smooth_time_embedding``), for step caches.
    """
    pipeline_class, components = BUILDERS[family](DIMS[size])
    for name, component in components.items():
        if isinstance(component, torch.nn.Module):
            seed_weights(component, seed + SEED_OFFSETS.get(name, 0))
            positive_variances(component)
            component.eval()
    if smooth_time:
        smooth_time_embedding(components["transformer"])
    pipeline = pipeline_class(**components)
    pipeline.save_pretrained(str(folder), safe_serialization=True)
    return folder


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and write the folder."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.make_pipeline",
        description="Write a diffusers-format pipeline folder with seeded random weights.",
    )
    parser.add_argument("family", choices=get_args(Family))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--size", choices=get_args(Size), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--smooth-time",
        action="store_true",
        help="zero the DiT's timestep MLP on its fast frequencies, so that adjacent steps "
        "differ as a trained model's do (for step caches)",
    )
    args = parser.parse_args(argv)
    folder = write_pipeline(
        args.family, args.folder, size=args.size, seed=args.seed, smooth_time=args.smooth_time
    )
    print(folder)


if __name__ == "__main__":
    main()

"""The reference component kinds, one module each, in the order ``registry.names()`` lists them."""

from components.kinds.autoencoder_kl import AutoencoderKlLoader
from components.kinds.autoencoder_kl_flux2 import AutoencoderKlFlux2Loader
from components.kinds.autoencoder_kl_qwen_image import AutoencoderKlQwenImageLoader
from components.kinds.autoencoder_kl_wan import AutoencoderKlWanLoader
from components.kinds.clip_text_encoder import ClipTextEncoderLoader
from components.kinds.clip_vision_encoder import ClipVisionEncoderLoader
from components.kinds.flux2_transformer import Flux2TransformerLoader
from components.kinds.flux_transformer import FluxTransformerLoader
from components.kinds.llm_text_encoder import LlmTextEncoderLoader
from components.kinds.minilm_text_encoder import MiniLmLoader
from components.kinds.pixart_transformer import PixArtTransformerLoader
from components.kinds.qwen_image_transformer import QwenImageTransformerLoader
from components.kinds.sd3_transformer import Sd3TransformerLoader
from components.kinds.t5_encoder import T5EncoderLoader
from components.kinds.tiny_dit import TinyDitLoader
from components.kinds.tiny_text_encoder import TinyTextEncoderLoader
from components.kinds.tiny_upsampler import TinyUpsamplerLoader
from components.kinds.tiny_vae import TinyVaeLoader
from components.kinds.umt5_encoder import Umt5EncoderLoader
from components.kinds.wan_transformer import WanTransformerLoader
from components.kinds.z_image_transformer import ZImageTransformerLoader
from components.loader import ComponentLoader

BUILTIN_KINDS: tuple[type[ComponentLoader], ...] = (
    TinyTextEncoderLoader,
    TinyDitLoader,
    TinyVaeLoader,
    TinyUpsamplerLoader,
    MiniLmLoader,
    T5EncoderLoader,
    ClipTextEncoderLoader,
    PixArtTransformerLoader,
    FluxTransformerLoader,
    Sd3TransformerLoader,
    AutoencoderKlLoader,
    LlmTextEncoderLoader,
    QwenImageTransformerLoader,
    AutoencoderKlQwenImageLoader,
    ZImageTransformerLoader,
    Flux2TransformerLoader,
    AutoencoderKlFlux2Loader,
    Umt5EncoderLoader,
    ClipVisionEncoderLoader,
    WanTransformerLoader,
    AutoencoderKlWanLoader,
)

__all__ = [
    "BUILTIN_KINDS",
    "AutoencoderKlFlux2Loader",
    "AutoencoderKlLoader",
    "AutoencoderKlQwenImageLoader",
    "AutoencoderKlWanLoader",
    "ClipTextEncoderLoader",
    "ClipVisionEncoderLoader",
    "Flux2TransformerLoader",
    "FluxTransformerLoader",
    "LlmTextEncoderLoader",
    "MiniLmLoader",
    "PixArtTransformerLoader",
    "QwenImageTransformerLoader",
    "Sd3TransformerLoader",
    "T5EncoderLoader",
    "TinyDitLoader",
    "TinyTextEncoderLoader",
    "TinyUpsamplerLoader",
    "TinyVaeLoader",
    "Umt5EncoderLoader",
    "WanTransformerLoader",
    "ZImageTransformerLoader",
]

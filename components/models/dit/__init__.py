"""The project's own DiTs for diffusers-format folders (PixArt, Flux, SD3, Qwen-Image,
Wan), requests packed."""

__all__: list[str] = []

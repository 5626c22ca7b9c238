"""The project's own DiTs for diffusers-format folders (PixArt, Flux, SD3), requests packed."""

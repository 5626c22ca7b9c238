"""Our own implementations of the real architectures a folder names, on ``attention.Attention``.

Each names its tensors exactly as the library's class stores them, so the folder's
files load into it as they are, and needs neither diffusers nor transformers.
"""

__all__: list[str] = []

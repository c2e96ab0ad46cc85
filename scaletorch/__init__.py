"""ScaleTorch: distributed training of transformer language models, one strategy at a time."""

__version__ = "0.1.0"

"""Optimizers for a DeepSpeed config's ``optimizer`` section."""

from .build import build_optimizer
from .lamb import Lamb

__all__ = ["Lamb", "build_optimizer"]

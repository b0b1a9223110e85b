"""``deepspeed.ops.lamb``: ``FusedLamb`` (:mod:`.fused_lamb`)."""

from .fused_lamb import FusedLamb

__all__ = ["FusedLamb"]

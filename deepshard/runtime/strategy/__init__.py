"""Data-parallel strategies: the one interface the engine drives (:mod:`.base`) and
stage 0's implementation (:mod:`.stage0`); ZeRO's is in :mod:`deepshard.runtime.zero`."""

from deepshard.runtime.strategy.base import DataParallelStrategy

__all__ = ["DataParallelStrategy"]

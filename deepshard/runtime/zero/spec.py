"""What ZeRO is asked to do, decided once from the config: :class:`ZeroSpec`.

The ``zero_optimization`` section (and the precision sections it depends on) is read here
and nowhere else on the way to the strategy: the assembly makes one spec, and the builders,
the strategy and the engine ask it what is sharded instead of comparing stage numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepshard.runtime.zero.optimizer import OffloadSpec


@dataclass(frozen=True)
class ParamOffload:
    """``zero_optimization.offload_param`` at stage 3, resolved (device ``none``: the
    shards stay on the training device)."""

    device: str = "none"
    nvme_path: str | None = None
    pin_memory: bool = False


@dataclass(frozen=True)
class ZeroSpec:
    """The data-parallel scheme one engine runs (stage 0 included), with its tunables."""

    stage: int
    """``zero_optimization.stage``: 0 plain data parallelism, 1 optimizer state sharded,
    2 gradients too, 3 parameters too."""
    half: bool = False
    """fp16 or bf16 training: fp32 masters are kept for the optimizer."""
    reduce_bucket_size: int = 500_000_000
    overlap_comm: bool = True
    persistence_threshold: int = 0
    """Stage 3: parameters this small stay whole on every rank."""
    prefetch_bucket_size: int = 0
    max_live_parameters: int = 0
    max_reuse_distance: int = 0
    offload_optimizer: OffloadSpec = field(default_factory=OffloadSpec)
    offload_param: ParamOffload = field(default_factory=ParamOffload)
    gather_16bit_weights_on_model_save: bool = False
    hpz_partition_size: int = 1
    quantized_weights: bool = False
    """Stage 3 (ZeRO++ qwZ): forward's and backward's gathers carry int8 blocks."""
    quantized_gradients: bool = False
    """Stage 3 (ZeRO++ qgZ): gradients reduced through two int8 all-to-alls."""
    quantized_nontrainable: bool = False
    """Stage 3 (ZeRO++): frozen parameters' shards stored (and gathered) as int8 blocks."""
    mics_shard_size: int = -1
    """Stage 3 (MiCS): shard over groups of this many consecutive ranks, replicated across
    the groups (gradients summed over the replicas once per step); -1: off."""
    """Stage 3 (ZeRO++ hpZ): a second copy of the parameters sharded over groups of this
    many consecutive ranks, which backward gathers from; 1: off."""

    @classmethod
    def from_config(cls, cfg: Any) -> ZeroSpec:
        """The spec of a :class:`~deepshard.config.DeepShardConfig`."""
        z = cfg.zero_optimization
        partitioned = z.stage == 3
        offload = z.offload_param if partitioned and z.offload_param else None
        return cls(
            stage=z.stage, half=bool(cfg.fp16.enabled or cfg.bf16.enabled),
            reduce_bucket_size=int(z.reduce_bucket_size), overlap_comm=bool(z.overlap_comm),
            persistence_threshold=int(z.stage3_param_persistence_threshold)
            if partitioned else 0,
            prefetch_bucket_size=int(z.stage3_prefetch_bucket_size),
            max_live_parameters=int(z.stage3_max_live_parameters),
            max_reuse_distance=int(z.stage3_max_reuse_distance),
            offload_optimizer=OffloadSpec.from_config(z.offload_optimizer),
            offload_param=ParamOffload(offload.device, offload.nvme_path,
                                       bool(offload.pin_memory))
            if offload is not None else ParamOffload(),
            gather_16bit_weights_on_model_save=bool(
                z.stage3_gather_16bit_weights_on_model_save),
            hpz_partition_size=int(z.zero_hpz_partition_size) if partitioned else 1,
            mics_shard_size=int(z.mics_shard_size) if partitioned else -1,
            quantized_weights=bool(z.zero_quantized_weights) and partitioned,
            quantized_gradients=bool(z.zero_quantized_gradients) and partitioned,
            quantized_nontrainable=bool(z.zero_quantized_nontrainable_weights)
            and partitioned)

    @property
    def shards_optimizer(self) -> bool:
        """Optimizer state (and fp32 masters) sharded: ZeRO is on."""
        return self.stage >= 1

    @property
    def shards_gradients(self) -> bool:
        """Gradients reduced into shards during every backward."""
        return self.stage >= 2

    @property
    def shards_parameters(self) -> bool:
        """Parameters partitioned, gathered per module around its use."""
        return self.stage >= 3

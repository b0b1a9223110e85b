"""The config loader: DeepSpeed's ``ds_config.json`` (or YAML) into one typed, frozen tree.

``load_config(source, world_size=...)`` is the entry point: it reads DeepSpeed's JSON dialect
(comments allowed, duplicate keys an error), resolves "auto" values and the batch triad,
and validates every key against DeepSpeed's names and defaults. Mistakes are
:class:`~deepshard.errors.UsageError` naming the file line or the dotted key path; keys
DeepSpeed knows that deepshard ignores are listed in ``LoadedConfig.unimplemented`` for one
warning. Nothing here imports torch.
"""

from deepshard.config.dialect import read_config_source
from deepshard.config.resolve import (
    LoadedConfig,
    load_config,
    parse_config,
    with_batch_triad,
)
from deepshard.config.schema import (
    ActivationCheckpointingConfig,
    BF16Config,
    CheckpointConfig,
    DeepShardConfig,
    FlopsProfilerConfig,
    FP16Config,
    ParallelWriteConfig,
)
from deepshard.config.schema_optim import (
    AdamParams,
    AdamWParams,
    LambParams,
    OneBitAdamParams,
    OneBitLambParams,
    OneCycleParams,
    OptimizerConfig,
    OptimizerParams,
    SchedulerConfig,
    SGDParams,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
    ZeroOneAdamParams,
)
from deepshard.config.schema_zero import (
    OffloadOptimizerConfig,
    OffloadParamConfig,
    ZeroConfig,
)

__all__ = [
    "ActivationCheckpointingConfig",
    "AdamParams",
    "AdamWParams",
    "BF16Config",
    "CheckpointConfig",
    "DeepShardConfig",
    "FP16Config",
    "FlopsProfilerConfig",
    "LambParams",
    "LoadedConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OneBitAdamParams",
    "OneBitLambParams",
    "OneCycleParams",
    "OptimizerConfig",
    "OptimizerParams",
    "ParallelWriteConfig",
    "SGDParams",
    "SchedulerConfig",
    "WarmupCosineLRParams",
    "WarmupDecayLRParams",
    "WarmupLRParams",
    "ZeroConfig",
    "ZeroOneAdamParams",
    "load_config",
    "parse_config",
    "read_config_source",
    "with_batch_triad",
]

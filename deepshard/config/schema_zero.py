"""The ``zero_optimization`` section and its offload blocks (DeepSpeed's key names and
defaults, from ``deepspeed/runtime/zero/config.py`` and ``offload_config.py``)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AliasChoices, ValidationInfo, model_validator

from deepshard.config.schema_base import (
    Bool,
    Int,
    KeyLog,
    NonNegInt,
    PosInt,
    Section,
    UnitFloat,
    doc,
    fail,
    key_log,
    one_of,
)

OffloadDevice = Annotated[Literal["none", "cpu", "nvme"], one_of("none", "cpu", "nvme")]


def _alias(*names: str) -> AliasChoices:
    return AliasChoices(*names)


class OffloadParamConfig(Section):
    """``zero_optimization.offload_param``: where stage 3 keeps parameters between uses."""

    device: OffloadDevice = doc("Where parameters live: 'none' (accelerator), 'cpu' or "
                                "'nvme'.", default="none")
    nvme_path: str | None = doc("Directory on the NVMe device for swapped parameters "
                                "(required with device 'nvme').", default=None)
    pin_memory: Bool = doc("Keep offloaded parameters in page-locked CPU memory.",
                           default=True)
    buffer_count: NonNegInt = doc("Number of buffers in the NVMe swap buffer pool.",
                                  default=5)
    buffer_size: NonNegInt = doc("Size in elements of each NVMe swap buffer.",
                                 default=100_000_000)
    max_in_cpu: NonNegInt = doc("Parameter elements kept in CPU memory when offloading to "
                                "NVMe.", default=1_000_000_000)

    @model_validator(mode="after")
    def _nvme_needs_path(self, info: ValidationInfo) -> OffloadParamConfig:
        _check_nvme_path(self.device, self.nvme_path, key_log(info))
        return self


class OffloadOptimizerConfig(Section):
    """``zero_optimization.offload_optimizer``: where the fp32 master shard and optimizer
    state live and where the optimizer step runs."""

    ds_only_keys: ClassVar[frozenset[str]] = frozenset({
        "pipeline_read", "pipeline_write", "super_offload", "cpuadam_cores_perc"})

    device: OffloadDevice = doc("Where optimizer state lives: 'none' (accelerator), 'cpu' or "
                                "'nvme' (the step runs on CPU for both).", default="none")
    nvme_path: str | None = doc("Directory on the NVMe device for swapped optimizer state "
                                "(required with device 'nvme').", default=None)
    pin_memory: Bool = doc("Keep offloaded optimizer state in page-locked CPU memory.",
                           default=True)
    buffer_count: NonNegInt = doc("Number of buffers in the NVMe swap buffer pool (at least "
                                  "the optimizer's states per parameter).", default=4)
    fast_init: Bool = doc("Fast optimizer initialization when offloading to NVMe.",
                          default=False)
    ratio: UnitFloat = doc("Fraction of optimizer state offloaded to CPU (below 1 only with "
                           "ZeRO stage 3).", default=1.0)

    @model_validator(mode="after")
    def _nvme_needs_path(self, info: ValidationInfo) -> OffloadOptimizerConfig:
        _check_nvme_path(self.device, self.nvme_path, key_log(info))
        return self


def _check_nvme_path(device: str, nvme_path: str | None, log: KeyLog | None) -> None:
    if device == "nvme" and not nvme_path:
        raise fail(log or KeyLog(), "nvme_path", "device 'nvme' needs an nvme_path",
                   "set nvme_path to a directory on the NVMe drive, or use device 'cpu'")


class ZeroConfig(Section):
    """``zero_optimization``: the ZeRO stage and its buckets, prefetching and offload."""

    ds_only_keys: ClassVar[frozenset[str]] = frozenset({
        "use_multi_rank_bucket_allreduce", "compute_grad_norm", "load_from_fp32_weights",
        "elastic_checkpoint", "zenflow", "cpu_offload_use_pin_memory",
        "stage3_model_persistence_threshold", "model_persistence_threshold",
        "stage3_module_granularity_threshold", "module_granularity_threshold",
        "stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params",
        "stage3_allgather_sequential", "allgather_sequential", "ignore_unused_parameters",
        "legacy_stage1", "parameter_alignment", "memory_efficient_linear",
        "pipeline_loading_checkpoint",
        "override_module_apply", "log_trace_cache_warnings", "enable_sanity_checks",
        "save_muon_momentum_buffer_in_memory", "leaf_module",
        # removed in DeepSpeed 0.19 (rejected there), known to earlier versions
        "zeropp_loco_param",
    })

    stage: Literal[0, 1, 2, 3] = doc("ZeRO stage: 0 off, 1 optimizer state sharded, 2 "
                                     "gradients too, 3 parameters too.", default=0)
    reduce_bucket_size: PosInt = doc("Elements reduced per gradient bucket.",
                                     default=500_000_000)
    allgather_bucket_size: NonNegInt = doc("Elements all-gathered per bucket when updated "
                                           "parameters are gathered (stages 1-2).",
                                           default=500_000_000)
    overlap_comm: Bool = doc("Overlap gradient reduction with the backward pass (default: "
                             "true at stage 3, false below, as in DeepSpeed).", default=False)
    contiguous_gradients: Bool = doc("Copy gradients into a contiguous buffer as they are "
                                     "produced.", default=True)
    reduce_scatter: Bool = doc("Average gradients with reduce-scatter rather than "
                               "all-reduce.", default=True)
    allgather_partitions: Bool = doc("Gather updated partitions with all-gather rather than a "
                                     "series of broadcasts.", default=True)
    round_robin_gradients: Bool = doc("Stages 1-2 with CPU offload: split gradient copies to "
                                      "CPU among ranks.", default=False)
    offload_optimizer: OffloadOptimizerConfig | None = doc(
        "Offload of optimizer state and step (stages 1-3); None: none.", default=None)
    offload_param: OffloadParamConfig | None = doc(
        "Offload of parameters (stage 3 only); None: none.", default=None)
    sub_group_size: NonNegInt = doc("Elements per tile when stepping an offloaded optimizer "
                                    "(stage 3 offload).", default=1_000_000_000)
    stage3_prefetch_bucket_size: NonNegInt = doc(
        "Stage 3: parameter elements fetched ahead of use.", default=50_000_000,
        validation_alias=_alias("stage3_prefetch_bucket_size", "prefetch_bucket_size"))
    stage3_param_persistence_threshold: NonNegInt = doc(
        "Stage 3: parameters smaller than this many elements are not partitioned.",
        default=100_000, validation_alias=_alias("stage3_param_persistence_threshold",
                                                 "param_persistence_threshold"))
    stage3_max_live_parameters: NonNegInt = doc(
        "Stage 3: most gathered parameter elements resident per rank before releasing.",
        default=1_000_000_000,
        validation_alias=_alias("stage3_max_live_parameters", "max_live_parameters"))
    stage3_max_reuse_distance: NonNegInt = doc(
        "Stage 3: keep a parameter gathered if it is reused within this many elements.",
        default=1_000_000_000,
        validation_alias=_alias("stage3_max_reuse_distance", "max_reuse_distance"))
    stage3_gather_16bit_weights_on_model_save: Bool = doc(
        "Stage 3: gather the full 16-bit weights when the model is saved.", default=False,
        validation_alias=_alias("stage3_gather_16bit_weights_on_model_save",
                                "gather_16bit_weights_on_model_save",
                                "stage3_gather_fp16_weights_on_model_save"))

    zero_hpz_partition_size: PosInt = doc(
        "Stage 3 (ZeRO++ hpZ): also keep each parameter sharded over groups of this many "
        "consecutive ranks (a node), and gather from that copy in backward; 1: off.",
        default=1)
    zero_quantized_weights: Bool = doc(
        "Stage 3 (ZeRO++ qwZ): forward's and backward's weight all-gathers carry int8 "
        "blocks of 256 with a scale each (lossy: within 1/254 of a block's largest "
        "magnitude); the optimizer's shards stay exact.", default=False)
    zero_quantized_nontrainable_weights: Bool = doc(
        "Stage 3 (ZeRO++): frozen parameters' shards kept as int8 blocks of 256 with a "
        "scale each (and gathered as such): a quarter of fp32's memory, lossy.",
        default=False)
    zero_quantized_gradients: Bool = doc(
        "Stage 3 (ZeRO++ qgZ): gradients reduced through two int8 all-to-alls, inside the "
        "node (zero_hpz_partition_size ranks, else the ranks per node) then across nodes; "
        "lossy, synchronous.", default=False)
    mics_shard_size: Int = doc(
        "Stage 3 (MiCS): shard over groups of this many consecutive ranks, replicated "
        "across the groups; -1: off (DeepSpeed 0.19 removed MiCS).", default=-1)
    mics_hierarchical_params_gather: Bool = doc(
        "MiCS's two-level parameter gather: not built yet, refused when true.",
        default=False)

    @classmethod
    def coerce(cls, data: Any, log: KeyLog) -> Any:
        # DeepSpeed's oldest form, "zero_optimization": true, means stage 1
        if isinstance(data, bool):
            return {"stage": int(data)}
        if isinstance(data, dict):
            data = _translate_cpu_offload(data, log, "cpu_offload", "offload_optimizer")
            data = _translate_cpu_offload(data, log, "cpu_offload_param", "offload_param")
        return data

    @classmethod
    def prepare(cls, data: dict[str, Any], log: KeyLog) -> dict[str, Any]:
        if data.get("overlap_comm") is None:
            data["overlap_comm"] = data.get("stage") == 3
        return data

    @model_validator(mode="after")
    def _partial_offload_needs_stage3(self, info: ValidationInfo) -> ZeroConfig:
        offload = self.offload_optimizer
        if offload is not None and offload.ratio < 1.0 and self.stage != 3:
            raise fail(key_log(info) or KeyLog(), "offload_optimizer.ratio",
                       f"partial optimizer offload (ratio {offload.ratio}) needs ZeRO stage 3, "
                       f"got stage {self.stage}",
                       "set ratio to 1.0, or zero_optimization.stage to 3")
        return self

    @model_validator(mode="after")
    def _zeropp_as_far_as_built(self, info: ValidationInfo) -> ZeroConfig:
        log = key_log(info) or KeyLog()
        if self.mics_hierarchical_params_gather:
            key = "mics_hierarchical_params_gather"
            raise fail(log, key, f"{key} changes how MiCS gathers and deepshard does not "
                       "implement it yet", f"drop {key} (mics_shard_size alone works)")
        for key, value, off in (("zero_hpz_partition_size", self.zero_hpz_partition_size, 1),
                                ("mics_shard_size", self.mics_shard_size, -1),
                                ("zero_quantized_weights", self.zero_quantized_weights,
                                 False),
                                ("zero_quantized_gradients", self.zero_quantized_gradients,
                                 False),
                                ("zero_quantized_nontrainable_weights",
                                 self.zero_quantized_nontrainable_weights, False)):
            if value != off and self.stage != 3:
                raise fail(log, key, f"{key} {value} needs ZeRO stage 3, got stage "
                           f"{self.stage}", f"set zero_optimization.stage to 3, or drop {key}")
        offload = self.offload_param
        if self.zero_quantized_nontrainable_weights and offload is not None and \
                offload.device == "nvme":
            raise fail(log, "zero_quantized_nontrainable_weights", "frozen weights stored "
                       "quantized cannot also be swapped to NVMe (offload_param nvme)",
                       "drop one of them (offload_param cpu works with it)")
        if self.mics_shard_size == 0 or self.mics_shard_size < -1:
            raise fail(log, "mics_shard_size", f"mics_shard_size {self.mics_shard_size} is "
                       "not a group size", "give a number of ranks, or -1 for off")
        if self.mics_shard_size != -1 and self.zero_hpz_partition_size != 1:
            raise fail(log, "mics_shard_size", "MiCS with hpZ is not supported",
                       "keep one of mics_shard_size and zero_hpz_partition_size")
        return self


def _translate_cpu_offload(data: dict[str, Any], log: KeyLog, old: str,
                           new: str) -> dict[str, Any]:
    """DeepSpeed's deprecated ``cpu_offload``/``cpu_offload_param`` booleans: true means
    ``{new: {"device": "cpu"}}``."""
    if old not in data:
        return data
    data = dict(data)
    value = data.pop(old)
    if value is None or value is False:
        return data
    if value is not True:
        raise fail(log, old, f"expected true or false, got {value!r}",
                   f"use {new}: {{\"device\": \"cpu\"}} instead (the current form)")
    if data.get(new) is not None:
        raise fail(log, old, f"both {old} (deprecated) and {new} are given",
                   f"remove {old}; {new} replaces it")
    data[new] = {"device": "cpu"}
    return data

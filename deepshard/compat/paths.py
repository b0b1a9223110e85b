"""Where deepshard defines each DeepSpeed import path: the one table of ``deepspeed.X.Y`` names.

Two kinds of rows:

- :data:`MODULES`: a DeepSpeed module that *is* a deepshard module (one object under two
  names, so ``isinstance`` checks and module state agree): ``deepspeed.zero`` is
  ``deepshard.runtime.zero``. What is under a listed module follows it
  (``deepspeed.zero.Init`` is ``deepshard.runtime.zero.Init``), and the longest listed prefix
  wins.
- :data:`NAMES`: a DeepSpeed package whose names deepshard defines in several modules
  (``deepspeed.pipe``, ``deepspeed.utils``): each name is a row ``"module:attribute"``. The
  alias builds such a package as an empty module whose attributes are looked up here; no
  deepshard module re-exports them (facades define nothing).

A ``deepspeed.X`` matched by neither is ``deepshard.X`` when that exists (``deepspeed.moe.layer``,
``deepspeed.runtime.lr_schedules``); anything else is what :mod:`.missing` explains. Pure data
and string functions: nothing here imports deepshard's runtime or torch.
"""

from __future__ import annotations

ALIAS = "deepspeed"
TARGET = "deepshard"

MODULES: dict[str, str] = {
    "deepspeed.zero": "deepshard.runtime.zero",
    "deepspeed.runtime.zero.partition_parameters": "deepshard.runtime.zero.init",
    "deepspeed.runtime.zero.offload_config": "deepshard.runtime.zero.states",
    "deepspeed.checkpointing": "deepshard.runtime.activation_checkpointing",
    "deepspeed.runtime.activation_checkpointing.checkpointing":
        "deepshard.runtime.activation_checkpointing",
    "deepspeed.runtime.sequence_parallel": "deepshard.sequence",
    "deepspeed.runtime.sequence_parallel.ulysses_sp": "deepshard.sequence",
    "deepspeed.runtime.pipe.engine": "deepshard.runtime.parallel.pipe_engine",
    "deepspeed.runtime.pipe.module": "deepshard.runtime.parallel.pipe_module",
    "deepspeed.runtime.pipe.topology": "deepshard.runtime.parallel.topology",
    "deepspeed.runtime.pipe.schedule": "deepshard.runtime.parallel.pipe_instructions",
    "deepspeed.runtime.config_utils": "deepshard.config.config_model",
    "deepspeed.runtime.constants": "deepshard.config.key_names",
    "deepspeed.runtime.precision_config": "deepshard.config.precision_models",
    "deepspeed.utils.zero_to_fp32": "deepshard.runtime.checkpoint.zero_to_fp32",
    "deepspeed.utils.logging": "deepshard.runtime.logs",
    "deepspeed.utils.groups": "deepshard.runtime.parallel.groups",
    "deepspeed.utils.tensor_fragment": "deepshard.runtime.tensor_fragment",
    "deepspeed.utils.comms_logging": "deepshard.comm.logger",
    "deepspeed.utils.timer": "deepshard.runtime.timer",
    "deepspeed.utils.torch": "deepshard.runtime.torch_version",
    "deepspeed.utils.nvtx": "deepshard.runtime.nvtx",
    "deepspeed.utils.init_on_device": "deepshard.runtime.on_device",
    "deepspeed.inference.engine": "deepshard.inference.engine",
    "deepspeed.ops.op_builder": "deepshard.runtime.op_builders",
    "deepspeed.checkpoint.utils": "deepshard.runtime.checkpoint.clone",
    "deepspeed.checkpoint.ds_to_universal": "deepshard.runtime.checkpoint.universal",
    "deepspeed.moe.utils": "deepshard.runtime.parallel.expert_params",
    "deepspeed.profiling.flops_profiler": "deepshard.runtime.flops_profiler_api",
    "deepspeed.profiling.flops_profiler.profiler": "deepshard.runtime.flops_profiler_api",
    "deepspeed.runtime.data_pipeline.curriculum_scheduler": "deepshard.data_efficiency.curriculum",
    "deepspeed.runtime.data_pipeline.data_routing.helper": "deepshard.data_efficiency.random_ltd",
    "deepspeed.runtime.data_pipeline.data_routing.basic_layer":
        "deepshard.data_efficiency.random_ltd",
    "deepspeed.runtime.data_pipeline.data_sampling.data_analyzer":
        "deepshard.data_efficiency.analyzer",
    "deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr":
        "deepshard.data_efficiency.dynamic_batching",
}
"""DeepSpeed module -> the deepshard module it is."""

_PIPE = {name: f"deepshard.runtime.parallel.pipe_module:{name}"
         for name in ("PipelineModule", "LayerSpec", "TiedLayerSpec")}
_FRAGMENT_API = [f"safe_{verb}_{scope}_{what}" for verb in ("get", "set")
                 for scope in ("full", "local")
                 for what in ("fp32_param", "grad", "optimizer_state")]

NAMES: dict[str, dict[str, str]] = {
    "deepspeed.pipe": _PIPE,
    "deepspeed.runtime.pipe": _PIPE,
    "deepspeed.utils": {
        "RepeatingLoader": "deepshard.runtime.utils:RepeatingLoader",
        "OnDevice": "deepshard.runtime.on_device:OnDevice",
        "instrument_w_nvtx": "deepshard.runtime.nvtx:instrument_w_nvtx",
        **{name: f"deepshard.runtime.zero.marks:{name}" for name in
           ("set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules",
            "z3_leaf_module", "z3_leaf_parameter", "set_z3_leaf_module",
            "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix")},
        **{name: f"deepshard.runtime.logs:{name}" for name in
           ("logger", "log_dist", "log_dist_once", "set_log_level_from_string")},
        **{name: f"deepshard.runtime.tensor_fragment:{name}" for name in
           [*_FRAGMENT_API, "safe_update_full_grad_vectorized"]},
    },
    "deepspeed.ops": {"__compatible_ops__": "deepshard.runtime.op_builders:COMPATIBLE_OPS"},
    "deepspeed.ops.adam": {name: f"deepshard.runtime.optim.adam:{name}"
                           for name in ("FusedAdam", "DeepSpeedCPUAdam")},
    "deepspeed.ops.adam.fused_adam": {"FusedAdam": "deepshard.runtime.optim.adam:FusedAdam"},
    "deepspeed.ops.adam.cpu_adam": {
        "DeepSpeedCPUAdam": "deepshard.runtime.optim.adam:DeepSpeedCPUAdam"},
    "deepspeed.ops.lamb": {"FusedLamb": "deepshard.runtime.optim.lamb:FusedLamb"},
    "deepspeed.ops.lamb.fused_lamb": {"FusedLamb": "deepshard.runtime.optim.lamb:FusedLamb"},
    "deepspeed.ops.adagrad": {
        "DeepSpeedCPUAdagrad": "deepshard.runtime.optim.adagrad:DeepSpeedCPUAdagrad"},
    "deepspeed.ops.adagrad.cpu_adagrad": {
        "DeepSpeedCPUAdagrad": "deepshard.runtime.optim.adagrad:DeepSpeedCPUAdagrad"},
    "deepspeed.ops.lion": {name: f"deepshard.runtime.optim.lion:{name}"
                           for name in ("DeepSpeedCPULion", "FusedLion")},
    "deepspeed.ops.lion.cpu_lion": {
        "DeepSpeedCPULion": "deepshard.runtime.optim.lion:DeepSpeedCPULion"},
    "deepspeed.ops.lion.fused_lion": {"FusedLion": "deepshard.runtime.optim.lion:FusedLion"},
    # the zero_optimization section is deepshard's validated one (DeepSpeed's keys; those
    # deepshard does not act on are accepted and dropped)
    "deepspeed.runtime.zero.config": {
        "DeepSpeedZeroConfig": "deepshard.config.schema_zero:ZeroConfig",
        "DeepSpeedZeroOffloadParamConfig": "deepshard.config.schema_zero:OffloadParamConfig",
        "DeepSpeedZeroOffloadOptimizerConfig":
            "deepshard.config.schema_zero:OffloadOptimizerConfig",
        "OffloadDeviceEnum": "deepshard.runtime.zero.states:OffloadDeviceEnum",
        "ZeroStageEnum": "deepshard.runtime.zero.stages:ZeroStageEnum",
    },
    "deepspeed.runtime.fp16": {},
    "deepspeed.runtime.data_pipeline": {},
    "deepspeed.runtime.data_pipeline.data_routing": {},
    "deepspeed.runtime.data_pipeline.data_sampling": {},
    "deepspeed.runtime.fp16.onebit": {},
    "deepspeed.runtime.fp16.onebit.adam": {
        name: f"deepshard.runtime.optim.onebit.adam:{name}" for name in ("OnebitAdam",
                                                                          "OneBitAdam")},
    "deepspeed.runtime.fp16.onebit.lamb": {
        name: f"deepshard.runtime.optim.onebit.lamb:{name}" for name in ("OnebitLamb",
                                                                          "OneBitLamb")},
    "deepspeed.runtime.fp16.onebit.zoadam": {
        "ZeroOneAdam": "deepshard.runtime.optim.onebit.zoadam:ZeroOneAdam"},
    # the engine's optimizer is a torch optimizer (DeepSpeed wraps its ZeRO ones in a base
    # class of its own; tools only test isinstance against it)
    "deepspeed.runtime.base_optimizer": {"DeepSpeedOptimizer": "torch.optim:Optimizer"},
    "deepspeed.git_version_info": {
        "version": "deepshard.compat.distribution:VERSION",
        "git_hash": "deepshard.compat.distribution:GIT_HASH",
        "git_branch": "deepshard.compat.distribution:GIT_BRANCH",
    },
    "deepspeed.runtime.config": {
        "DeepSpeedConfig": "deepshard.runtime.ds_config:DeepSpeedConfig",
        "DeepSpeedConfigError": "deepshard.errors:UsageError",
    },
    "deepspeed.launcher": {},
    "deepspeed.launcher.runner": {
        "DEEPSPEED_ENVIRONMENT_NAME": "deepshard.launcher.env_file:DEEPSPEED_ENVIRONMENT_NAME",
        "main": "deepshard.launcher.entry:deepspeed_main",
    },
    "deepspeed.checkpoint": {},
    "deepspeed.profiling": {},
    "deepspeed.inference": {"InferenceEngine": "deepshard.inference.engine:InferenceEngine"},
    "deepspeed.inference.config": {
        "DeepSpeedInferenceConfig": "deepshard.config.schema_inference:InferenceSection"},
}
"""DeepSpeed package -> {name: ``"deepshard.module:attribute"``} for the packages the alias
builds (an empty dict: a package that only holds listed submodules)."""


def module_row(name: str) -> str | None:
    """The deepshard module a ``deepspeed`` module name is, by the longest :data:`MODULES`
    prefix (``deepspeed.zero.init`` -> ``deepshard.runtime.zero.init``); None when no row
    matches."""
    parts = name.split(".")
    for end in range(len(parts), 1, -1):
        row = MODULES.get(".".join(parts[:end]))
        if row is not None:
            return ".".join([row, *parts[end:]])
    return None


def target_name(name: str) -> str:
    """The deepshard module behind ``name`` (``deepspeed`` or ``deepspeed.x.y``) when it is a
    module: a :data:`MODULES` row, else the same path under ``deepshard``. Names of
    :data:`NAMES` packages are not modules of deepshard; ask :func:`is_built` first."""
    if name != ALIAS and not name.startswith(ALIAS + "."):
        raise ValueError(f"{name!r} is not a {ALIAS} module name")
    row = module_row(name)
    if row is not None:
        return row
    return TARGET + name[len(ALIAS):]


def is_built(name: str) -> bool:
    """Whether ``name`` is a package the alias builds from :data:`NAMES` rows."""
    return name in NAMES


def split_row(row: str) -> tuple[str, str]:
    """``"deepshard.module:attribute"`` -> ``("deepshard.module", "attribute")``."""
    module, _, attribute = row.partition(":")
    return module, attribute

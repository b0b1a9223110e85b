"""DeepSpeed modules and top-level names deepshard does not have, and what to use instead.

Consulted only after deepshard turned out not to provide the name, so an entry for
something deepshard adds later is harmless. A name is matched by its longest listed
prefix (``deepspeed.ops.transformer.inference`` by ``deepspeed.ops.transformer``); one that
matches nothing gets a generic message. The errors are :class:`~deepshard.errors.UsageError`
(one line and exit code 2 when uncaught in a worker) and also what Python code expects
from a failed import or attribute lookup: ``except ImportError`` and ``hasattr`` still work.
"""

from __future__ import annotations

from deepshard.errors import UsageError


class Missing:
    """What a DeepSpeed name is (``api``) and the closest deepshard feature (``instead``).

    A plain slotted class, not a dataclass: every worker under --deepspeed_compat imports
    this module, and ``dataclasses`` costs ~15 ms to import.
    """

    __slots__ = ("api", "instead")

    def __init__(self, api: str, instead: str):
        self.api = api
        self.instead = instead


_INFERENCE = Missing("DeepSpeed-FastGen (deepspeed.inference.v2, MII's engine)",
                     "deepshard.init_inference (deepspeed.init_inference under "
                     "--deepspeed_compat) with tensor_parallel, and HF generate")
_NVME = ("NVMe offload is the config's zero_optimization.offload_optimizer/offload_param "
         "with device \"nvme\"")
_CPU_OFFLOAD = "CPU offload is the config's zero_optimization.offload_optimizer.device \"cpu\""
_MICS = Missing("MiCS (MiCS_Init, MiCS_Optimizer: ZeRO-3 sharded within groups of "
                "mics_shard_size ranks, replicated across them)",
                "MiCS is the config's zero_optimization.mics_shard_size at stage 3 (with "
                "deepspeed.zero.Init to build the model sharded)")
_CHECKPOINTS = ("engine.save_checkpoint/load_checkpoint; deepshard.get_fp32_state_dict "
                "consolidates a ZeRO checkpoint")

MODULES: dict[str, Missing] = {
    "deepspeed.inference.v2": _INFERENCE,
    "deepspeed.model_implementations": Missing("DeepSpeed-Inference's model implementations",
                                               _INFERENCE.instead),
    "deepspeed.module_inject": Missing(
        "kernel injection (replace_transformer_layer, module_inject.auto_tp)",
        "init_inference applies AutoTP itself (replace_with_kernel_inject=True routes "
        "attention through SDPA); training takes the config's tensor_parallel.autotp_size"),
    "deepspeed.ops": Missing("DeepSpeed's C++/CUDA ops",
                             "deepshard.runtime.optim holds the fused optimizers, "
                             "deepshard.kernels the CUDA kernels (ds_report shows which load)"),
    "deepspeed.ops.transformer": Missing(
        "the fused DeepSpeedTransformerLayer",
        "keep your model's own layers; deepshard's fused bias-GELU, layer norm and softmax "
        "kernels are in deepshard.kernels"),
    "deepspeed.ops.aio": Missing("the async NVMe I/O op", _NVME),
    "deepspeed.ops.gds": Missing("GPUDirect Storage I/O", _NVME),
    "deepspeed.ops.quantizer": Missing("the quantization kernels", "no deepshard equivalent"),
    "deepspeed.ops.fp_quantizer": Missing("the FP8/FP6 quantizer", "no deepshard equivalent"),
    "deepspeed.ops.deepspeed4science": Missing("DS4Sci EvoformerAttention",
                                               "no deepshard equivalent"),
    "deepspeed.ops.random_ltd": Missing("random-LTD token dropping", "no deepshard equivalent"),
    "deepspeed.ops.triton_ops": Missing("the Triton inference kernels", _INFERENCE.instead),
    "deepspeed.nvme": Missing("the NVMe tools (ds_nvme_tune, perf sweeps)", _NVME),
    "deepspeed.io": Missing("DeepSpeed's fast file writers", _CHECKPOINTS),
    "deepspeed.compression": Missing("DeepSpeed Compression (quantization/pruning-aware "
                                     "training)",
                                     "no deepshard equivalent; torch.ao quantizes and prunes"),
    "deepspeed.autotuning": Missing(
        "the autotuner",
        "no deepshard equivalent; set train_micro_batch_size_per_gpu and "
        "zero_optimization.stage in the config"),
    "deepspeed.elasticity": Missing("elastic training", "ds-run --max_restarts relaunches the "
                                    "job after a failure"),
    "deepspeed.linear": Missing("OptimizedLinear / LoRA", "no deepshard equivalent; peft "
                                "provides LoRA layers"),
    "deepspeed.compile": Missing("DeepCompile", "call torch.compile on the model"),
    "deepspeed.checkpoint": Missing("universal checkpoints (DeepSpeedCheckpoint, "
                                    "ds_to_universal)", _CHECKPOINTS),
    "deepspeed.datastates": Missing("DataStates asynchronous checkpointing", _CHECKPOINTS),
    "deepspeed.env_report": Missing("ds_report's module", "run ds_report"),
    "deepspeed.launcher.launch": Missing("DeepSpeed's per-node launcher",
                                         "the launcher is ds-run (or `deepspeed` after "
                                         "ds-compat install); a worker reads its environment "
                                         "with deepspeed.init_distributed()"),
    "deepspeed.launcher.multinode_runner": Missing("DeepSpeed's multi-node runner classes",
                                                   "ds-run --launcher ssh|pdsh|slurm|mpi"),
    "deepspeed.runtime.zero.mics": _MICS,
    # the alias looks an unknown attribute of deepspeed.zero up as a submodule, so the
    # class is named here too: `deepspeed.zero.MiCS_Init(...)` is this one line
    "deepspeed.zero.MiCS_Init": _MICS,
    "deepspeed.runtime.zero.stage_1_and_2": Missing(
        "DeepSpeedZeroOptimizer (ZeRO stages 1 and 2)",
        "set zero_optimization.stage to 1 or 2 in the config: deepspeed.initialize builds "
        "deepshard's ZeRO strategy"),
    "deepspeed.runtime.fp16": Missing("DeepSpeed's fp16 optimizer wrappers",
                                      "set fp16.enabled in the config: deepspeed.initialize "
                                      "wraps the optimizer and scales the loss"),
    "deepspeed.runtime.bf16_optimizer": Missing("BF16_Optimizer",
                                                "set bf16.enabled in the config"),
    "deepspeed.runtime.comm": Missing("the compressed-communication backends",
                                      "no deepshard equivalent"),
    "deepspeed.runtime.hybrid_engine": Missing("the RLHF hybrid engine",
                                               "no deepshard equivalent"),
    "deepspeed.runtime.data_pipeline.data_sampling.data_sampler": Missing(
        "DeepSpeedDataSampler", "set data_efficiency.data_sampling.curriculum_learning in the "
        "config: initialize(training_data=...) returns the curriculum loader"),
    "deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset": Missing(
        "MMapIndexedDataset", "deepshard.data_efficiency.index_files.open_index reads (and "
        "write_index writes) the same .bin/.idx files"),
    "deepspeed.runtime.data_pipeline.data_routing.scheduler": Missing(
        "RandomLTDScheduler", "set data_efficiency.data_routing.random_ltd in the config: the "
        "engine builds deepshard.data_efficiency.ltd_schedule.RandomLtdSchedule"),
    "deepspeed.runtime.swap_tensor": Missing("NVMe tensor swapping", _NVME),
    "deepspeed.runtime.superoffload": Missing("SuperOffload", _CPU_OFFLOAD),
    "deepspeed.runtime.zenflow": Missing("ZenFlow", _CPU_OFFLOAD),
    "deepspeed.runtime.domino": Missing("Domino tensor-parallel overlap",
                                        "tensor parallelism is the config's "
                                        "tensor_parallel.autotp_size"),
    "deepspeed.runtime.checkpoint_engine": Missing("pluggable checkpoint engines",
                                                   _CHECKPOINTS),
    "deepspeed.runtime.sequence_parallel.parallel_state_sp": Missing(
        "ALST's module-level sequence-parallel groups (parallel_state_sp)",
        "UlyssesSPAttentionHF.register_with_transformers returns the groups as mpu; "
        "deepshard.sequence.hf.sequence_groups(size) builds them without transformers"),
}
"""DeepSpeed 0.19.8 modules (by dotted name) deepshard does not provide."""

ATTRIBUTES: dict[str, Missing] = {
    "default_inference_config": Missing("the default inference config as a dict",
                                        "deepshard.config.schema_inference.InferenceSpec() "
                                        "holds DeepSpeed's defaults"),
    "DeepSpeedTransformerLayer": MODULES["deepspeed.ops.transformer"],
    "DeepSpeedTransformerConfig": MODULES["deepspeed.ops.transformer"],
    "replace_transformer_layer": MODULES["deepspeed.module_inject"],
    "module_inject": MODULES["deepspeed.module_inject"],
    "DeepSpeedHybridEngine": MODULES["deepspeed.runtime.hybrid_engine"],
    "DualPipeVEngine": Missing("the DualPipeV schedule", "deepspeed.pipe.PipelineModule with "
                               "the config's pipeline section"),
    "DualPipeVModule": Missing("the DualPipeV schedule", "deepspeed.pipe.PipelineModule with "
                               "the config's pipeline section"),
}
"""Top-level ``deepspeed.X`` names of DeepSpeed 0.19.8 deepshard does not provide."""

GENERIC = "run without --deepspeed_compat to use DeepSpeed itself"
_WHY = "(under --deepspeed_compat, deepspeed is deepshard)"


class MissingDeepSpeedModule(UsageError, ModuleNotFoundError):
    """``import deepspeed.X`` where deepshard has no ``X``: one line, and an ImportError."""

    def __init__(self, name: str, message: str, hint: str):
        super().__init__(message, where=name, hint=hint)
        self.name = name


class MissingDeepSpeedAttribute(UsageError, AttributeError):
    """``deepspeed.X`` for a DeepSpeed name deepshard lacks: one line, and an
    AttributeError (so ``hasattr`` is still False)."""

    def __init__(self, name: str, message: str, hint: str):
        super().__init__(message, where=f"deepspeed.{name}", hint=hint)
        self.name = name


def lookup(name: str) -> Missing | None:
    """The entry for the longest listed prefix of ``name`` (whole dotted components)."""
    parts = name.split(".")
    for end in range(len(parts), 1, -1):
        entry = MODULES.get(".".join(parts[:end]))
        if entry is not None:
            return entry
    return None


def module_error(name: str) -> MissingDeepSpeedModule:
    """The error for ``import <name>`` (a ``deepspeed.`` name deepshard lacks)."""
    entry = lookup(name)
    if entry is None:
        return MissingDeepSpeedModule(name, f"no deepshard counterpart for this DeepSpeed "
                                            f"module {_WHY}", GENERIC)
    return MissingDeepSpeedModule(name, f"no deepshard counterpart for {entry.api} {_WHY}",
                                  entry.instead)


def attribute_error(name: str) -> MissingDeepSpeedAttribute | None:
    """The error for ``deepspeed.<name>`` when it is a DeepSpeed API deepshard lacks;
    ``None`` for any other name (a plain AttributeError is right then)."""
    entry = ATTRIBUTES.get(name)
    if entry is None:
        return None
    return MissingDeepSpeedAttribute(name, f"no deepshard counterpart for {entry.api} {_WHY}",
                                     entry.instead)

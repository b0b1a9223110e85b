"""The typed config tree: DeepSpeed's keys, DeepSpeed's defaults, one-line errors.

Attribute names are DeepSpeed's key names (``cfg.fp16.initial_scale_power``); every model is
frozen. :func:`validate_config` is the one entry point from a raw mapping: it returns the
config and the dotted paths of keys DeepSpeed knows that deepshard ignores. Batch-size
arithmetic and "auto" values are resolved before and after it, in ``resolve.py``.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AliasChoices, ValidationInfo, model_validator

from deepshard.config.schema_base import (
    Bool,
    Int,
    Interval,
    KeyLog,
    NonNegFloat,
    NonNegInt,
    PosFloat,
    PosInt,
    Section,
    doc,
    fail,
    key_log,
    one_of,
)
from deepshard.config.schema_comm import CommsLoggerConfig
from deepshard.config.schema_compile import CompileConfig
from deepshard.config.schema_data import DataEfficiencyConfig
from deepshard.config.schema_elastic import ElasticityConfig
from deepshard.config.schema_monitor import (
    CometConfig,
    CSVConfig,
    MonitorConfig,
    TensorBoardConfig,
    WandbConfig,
)
from deepshard.config.schema_optim import OptimizerConfig, SchedulerConfig
from deepshard.config.schema_sequence import SequenceParallelConfig
from deepshard.config.schema_zero import ZeroConfig
from deepshard.errors import UsageError


class FP16Config(Section):
    """``fp16``: fp16 mixed precision with (by default dynamic) loss scaling."""

    ds_only_keys: ClassVar[frozenset[str]] = frozenset({"fp16_master_weights_and_grads"})

    enabled: Bool = doc("Train in fp16 mixed precision.", default=False)
    auto_cast: Bool = doc("Cast the model's floating-point inputs to fp16.", default=False)
    loss_scale: NonNegFloat = doc("Static loss scale; 0 selects dynamic loss scaling.",
                                  default=0.0)
    initial_scale_power: Int = doc("Dynamic scaling starts at 2**initial_scale_power.",
                                   default=16)
    loss_scale_window: Int = doc("Steps without overflow before the dynamic scale is "
                                 "raised.", default=1000)
    hysteresis: Int = doc("Overflows tolerated before the dynamic scale is lowered.",
                          default=2)
    consecutive_hysteresis: Bool = doc("Refill the hysteresis after every step without "
                                       "overflow.", default=False)
    min_loss_scale: NonNegFloat = doc("Lower bound of the dynamic loss scale.", default=1.0)

    @model_validator(mode="after")
    def _dynamic_scaling_bounds(self, info: ValidationInfo) -> FP16Config:
        log = key_log(info) or KeyLog()
        if self.enabled and self.loss_scale == 0:
            if self.loss_scale_window <= 0:
                raise UsageError(f"expected a positive integer, got {self.loss_scale_window}",
                                 where=log.where("loss_scale_window"),
                                 hint="dynamic loss scaling (loss_scale 0) needs a window "
                                      "of at least 1 step")
            if self.min_loss_scale <= 0:
                raise UsageError(f"expected a positive number, got {self.min_loss_scale}",
                                 where=log.where("min_loss_scale"),
                                 hint="dynamic loss scaling needs a positive floor, e.g. 1")
        return self


class BF16Config(Section):
    """``bf16`` (alias ``bfloat16``): bf16 mixed precision, no loss scaling."""

    ds_only_keys: ClassVar[frozenset[str]] = frozenset({
        "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
        "bf16_optimizer_states"})

    enabled: Bool = doc("Train in bf16 mixed precision.", default=False)


class ActivationCheckpointingConfig(Section):
    """``activation_checkpointing``: options of DeepSpeed's activation checkpointing API."""

    partition_activations: Bool = doc("Shard checkpointed activations across model-parallel "
                                      "ranks.", default=False)
    contiguous_memory_optimization: Bool = doc("Copy checkpointed activations into one "
                                               "contiguous buffer.", default=False)
    cpu_checkpointing: Bool = doc("Keep checkpointed activations in CPU memory.",
                                  default=False)
    number_checkpoints: NonNegInt | None = doc(
        "Number of checkpoints, to size the contiguous buffer; None: unknown.", default=None)
    synchronize_checkpoint_boundary: Bool = doc("Synchronize the device at each checkpoint "
                                                "boundary.", default=False)
    profile: Bool = doc("Time the checkpointed forward and recompute passes.", default=False)

    @classmethod
    def prepare(cls, data: dict[str, Any], log: KeyLog) -> dict[str, Any]:
        if data.get("number_checkpoints") is False:  # seen in the wild; DeepSpeed takes it
            data = {**data, "number_checkpoints": None}
        return data


class FlopsProfilerConfig(Section):
    """``flops_profiler``: count FLOPs and time modules at one step."""

    enabled: Bool = doc("Profile one training step.", default=False)
    recompute_fwd_factor: NonNegFloat = doc("Extra forward passes per step from activation "
                                            "recomputation (0 to 1).", default=0.0)
    profile_step: PosInt = doc("The step to profile.", default=1)
    module_depth: Int = doc("Depth of modules to report; -1: all.", default=-1)
    top_modules: PosInt = doc("Number of top modules to list in the aggregated report.",
                              default=1)
    detailed: Bool = doc("Print the per-module breakdown.", default=True)
    output_file: str | None = doc("File to write the report to; None: the log.",
                                  default=None)


class PipelineConfig(Section):
    """``pipeline``: pipeline parallelism over the stages of a ``PipelineModule``."""

    ds_only_keys: ClassVar[frozenset[str]] = frozenset({
        "partition", "seed_layers", "pipe_partitioned", "grad_partitioned"})

    stages: PosInt = doc("Pipeline stages ('auto': the PipelineModule's num_stages, else 1).",
                         default=1)
    partition_method: str = doc("How layers are split over stages: 'parameters', 'uniform' "
                                "or 'type:<regex>' (used when the script leaves it to the "
                                "config).", default="parameters")
    activation_checkpoint_interval: NonNegInt = doc(
        "Recompute activations every this many layers in backward; 0: the PipelineModule's "
        "own interval (a positive value replaces it, as in DeepSpeed).", default=0)
    use_reentrant: Bool = doc(
        "DeepSpeed's choice of recompute function. deepshard always recomputes with torch's "
        "non-reentrant checkpoint unless the PipelineModule was given one: the same "
        "gradients, where the reentrant one loses the parameter gradients of a chunk whose "
        "inputs need none (the first stage's).", default=True)

    @model_validator(mode="after")
    def _method(self, info: ValidationInfo) -> PipelineConfig:
        m = self.partition_method
        if m.lower() not in ("parameters", "uniform") and not m.lower().startswith("type:"):
            raise fail(key_log(info) or KeyLog(), "partition_method",
                       f"unknown partition method {m!r}",
                       "use 'parameters', 'uniform' or 'type:<regex of layer class names>'")
        return self


class TensorParallelConfig(Section):
    """``tensor_parallel``: Megatron-style tensor parallelism applied by AutoTP."""

    ds_only_keys: ClassVar[frozenset[str]] = frozenset({
        "tp", "tp_grain_size", "dtype", "keep_module_on_host", "injection_policy_tuple",
        "partition_config", "tp_overlap_comm"})

    autotp_size: PosInt = doc("Ranks each layer is split over (1: no tensor parallelism).",
                              default=1)


class ParallelWriteConfig(Section):
    """``checkpoint.parallel_write``."""

    pipeline_stage: Bool = doc("Each pipeline stage writes its own checkpoint files.",
                               default=False)


class CheckpointConfig(Section):
    """``checkpoint``: DeepSpeed's checkpoint options, plus deepshard's resume policy."""

    ds_only_keys: ClassVar[frozenset[str]] = frozenset({"checkpoint_serialization", "writer"})

    tag_validation: Annotated[Literal["Ignore", "Warn", "Fail"],
                              one_of("Ignore", "Warn", "Fail", case_insensitive=True)] = doc(
        "What to do when ranks save under different tags: Ignore, Warn or Fail (any letter "
        "case).", default="Warn")
    load_universal: Bool = doc(
        "Load a universal (world-size independent) checkpoint: latest_universal before "
        "latest. Without it a universal folder still loads where it is the only "
        "checkpoint there, or is named by tag.", default=False)
    use_node_local_storage: Bool = doc("Each node writes to its own storage (one rank per "
                                       "node saves the shared files).", default=False)
    parallel_write: ParallelWriteConfig = doc("Parallel checkpoint writing options.",
                                              default_factory=ParallelWriteConfig)
    format: Annotated[Literal["deepshard", "deepspeed"], one_of("deepshard", "deepspeed")] = doc(
        "deepshard: the layout save_checkpoint writes: 'deepshard' (a manifest and a file "
        "per rank; loads at any world size, stage and layout) or 'deepspeed' (DeepSpeed "
        "0.19.8's own files, which DeepSpeed loads at the same world size and stage; "
        "data-parallel jobs, ZeRO 0-3). Both load in deepshard.", default="deepshard")
    resume_dir: str | None = doc(
        "deepshard: a checkpoint directory from which initialize() loads the latest complete "
        "tag; None: no automatic resume.", default=None)
    resume: Annotated[Literal["on_restart", "always", "never"],
                      one_of("on_restart", "always", "never")] = doc(
        "deepshard: when to resume from resume_dir: 'on_restart' (only when the launcher "
        "restarted the job, DEEPSHARD_RESTART_COUNT > 0), 'always' or 'never'.",
        default="on_restart")


CommDtype = Annotated[Literal["fp32", "fp16", "bf16"],
                      one_of("fp32", "fp16", "bf16", case_insensitive=True)]


class DataTypesConfig(Section):
    """``data_types``: DeepSpeed's gradient accumulation dtype."""

    grad_accum_dtype: CommDtype | None = doc(
        "dtype gradients accumulate in: deepshard accumulates them in the training dtype "
        "(fp32, or bf16/fp16 when enabled); that value or None is accepted, another one "
        "refused (DeepSpeed refuses the same mixes at stage 0).", default=None)


class DeepShardConfig(Section):
    """The whole config (DeepSpeed's ``ds_config.json``), validated.

    The batch triad is ``None`` where the file leaves it out; :func:`load_config` returns it
    resolved to three ints consistent with the world size.
    """

    ds_only_keys: ClassVar[frozenset[str]] = frozenset({
        "memory_breakdown", "dump_state", "disable_allgather",
        "disable_python_gc", "dataloader_drop_last", "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer", "managed_gradient_accumulation",
        "seq_parallel_communication_data_type", "vocabulary_size", "log_level",
        "use_data_before_expert_parallelism", "allgather_size",
        "data_parallel_size",
        "torch_autocast", "aio",
        "autotuning", "timers",
        "hybrid_engine",
        "weight_quantization", "datastates_ckpt",
        # removed in DeepSpeed 0.19 (rejected there), known to earlier versions
        "amp", "nebula", "compression_training", "quantize_training", "sparse_gradients",
        "eigenvalue", "sparse_attention", "graph_harvesting",
        "progressive_layer_drop",
    })

    train_batch_size: PosInt | None = doc(
        "Samples per optimizer step over all data-parallel ranks (= micro batch * "
        "accumulation steps * data-parallel size).", default=None)
    train_micro_batch_size_per_gpu: PosInt | None = doc(
        "Samples per forward/backward pass on one rank.", default=None)
    gradient_accumulation_steps: PosInt | None = doc(
        "Micro batches accumulated per optimizer step.", default=None)
    expert_parallel: dict[str, Any] = doc(
        "DeepSpeed's AutoEP section ({'enabled': true, 'autoep_size': N, 'preset_model': "
        "'mixtral'}): initialize shards the experts of an HF MoE model (Mixtral, Qwen2-MoE, "
        "Qwen3-MoE) over N ranks of the data-parallel axis (deepshard.moe.hf); its keys are "
        "checked there.", default_factory=dict)
    sequence_parallel_size: PosInt = doc(
        "Ranks of one Ulysses sequence-parallel group (consecutive ranks): they share each "
        "batch, every one holding 1/size of its tokens; the data-parallel size the batch "
        "triad counts is world / (sequence_parallel_size x pipeline x tensor parallel).",
        default=1)
    steps_per_print: Interval = doc(
        "Log progress every this many steps; None or infinity: never (DeepSpeed 0.19's "
        "default).",
        default=None)
    gradient_clipping: NonNegFloat = doc(
        "Clip the global gradient norm to this value; 0: no clipping (DeepSpeed 0.19's "
        "default is 1.0).", default=1.0)
    prescale_gradients: Bool = doc("Divide gradients by the data-parallel size before the "
                                   "all-reduce rather than after.", default=False)
    gradient_predivide_factor: PosFloat = doc("Divide gradients by this factor before the "
                                              "all-reduce and the rest after.", default=1.0)
    gradient_allreduce_op: Annotated[Literal["mean", "sum"],
                                     one_of("mean", "sum", case_insensitive=True)] = doc(
        "How data-parallel gradients combine: 'mean' (averaged) or 'sum' (DeepSpeed 0.19's "
        "key; 'sum' at ZeRO stages 0-2, as DeepSpeed).", default="mean")
    communication_data_type: CommDtype | None = doc(
        "dtype of gradient collectives: 'fp32', 'fp16' or 'bf16'; None: the training "
        "dtype.", default=None)
    optimizer: OptimizerConfig | None = doc("The optimizer the engine builds; None: the "
                                            "caller passes one.", default=None)
    scheduler: SchedulerConfig | None = doc("The LR schedule the engine builds; None: the "
                                            "caller passes one, or none.", default=None)
    data_types: DataTypesConfig = doc("Gradient accumulation dtype.",
                                      default_factory=DataTypesConfig)
    fp16: FP16Config = doc("fp16 mixed precision.", default_factory=FP16Config)
    bf16: BF16Config = doc("bf16 mixed precision (the key may also be spelled 'bfloat16').",
                           default_factory=BF16Config,
                           validation_alias=AliasChoices("bf16", "bfloat16"))
    zero_optimization: ZeroConfig = doc("ZeRO stage and its options.",
                                        default_factory=ZeroConfig)
    activation_checkpointing: ActivationCheckpointingConfig = doc(
        "Activation checkpointing options.", default_factory=ActivationCheckpointingConfig)
    pipeline: PipelineConfig = doc("Pipeline parallelism.", default_factory=PipelineConfig)
    tensor_parallel: TensorParallelConfig = doc("Tensor parallelism (AutoTP).",
                                                default_factory=TensorParallelConfig)
    flops_profiler: FlopsProfilerConfig = doc("FLOPs profiler options.",
                                              default_factory=FlopsProfilerConfig)
    comms_logger: CommsLoggerConfig = doc("Comms logger: time deepshard.comm collectives.",
                                          default_factory=CommsLoggerConfig)
    checkpoint: CheckpointConfig = doc("Checkpoint options and deepshard's resume policy.",
                                       default_factory=CheckpointConfig)
    elasticity: ElasticityConfig = doc(
        "DeepSpeed's elastic batch arithmetic (removed in DeepSpeed 0.19, kept here): one "
        "train batch size for a range of world sizes.", default_factory=ElasticityConfig)
    data_efficiency: DataEfficiencyConfig = doc(
        "DeepSpeed's data-efficiency library: curriculum learning, dynamic batching, "
        "random-LTD (deepshard.data_efficiency).", default_factory=DataEfficiencyConfig)
    sequence_parallel: SequenceParallelConfig = doc(
        "ALST's memory switches for long sequences (tiled MLP, tiled logits + loss, "
        "checkpointed activations in host memory).", default_factory=SequenceParallelConfig)
    compile: CompileConfig = doc(
        "Compile the model at initialize (torch.compile), in DeepSpeed 0.19.8's DeepCompile "
        "schema or the torch.compile one of DeepSpeed <= 0.15.",
        default_factory=CompileConfig)
    wall_clock_breakdown: Bool = doc(
        "Time forward, backward and step: a 'time (ms)' line on rank 0 every "
        "steps_per_print steps (every step when that is unset), and elapsed_time_ms_* "
        "events for the enabled monitors.", default=False)
    tensorboard: TensorBoardConfig = doc("TensorBoard monitor.",
                                         default_factory=TensorBoardConfig)
    wandb: WandbConfig = doc("Weights & Biases monitor.", default_factory=WandbConfig)
    csv_monitor: CSVConfig = doc("CSV file monitor.", default_factory=CSVConfig)
    comet: CometConfig = doc("Comet monitor.", default_factory=CometConfig)

    @property
    def monitor_config(self) -> MonitorConfig:
        """The four monitor sections together (DeepSpeed's ``_config.monitor_config``)."""
        return MonitorConfig(tensorboard=self.tensorboard, wandb=self.wandb,
                             csv_monitor=self.csv_monitor, comet=self.comet)

    @classmethod
    def coerce(cls, data: Any, log: KeyLog) -> Any:
        if isinstance(data, dict) and "curriculum_learning" in data:
            # it changes the batches, so it is refused (as DeepSpeed 0.19 does), not ignored
            raise UsageError("the legacy top-level curriculum_learning section was removed "
                             "in DeepSpeed 0.19", where=log.where("curriculum_learning"),
                             hint="move it to data_efficiency.data_sampling."
                                  "curriculum_learning, with the metric seqlen_truncate "
                                  "(docs/data_efficiency.md)")
        return data

    @classmethod
    def prepare(cls, data: dict[str, Any], log: KeyLog) -> dict[str, Any]:
        if "bf16" in data and "bfloat16" in data:
            raise UsageError("both bf16 and its old spelling bfloat16 are given",
                             where=log.where("bfloat16"), hint="keep only bf16")
        return data

    @model_validator(mode="after")
    def _sum_below_stage_3(self, info: ValidationInfo) -> DeepShardConfig:
        if self.gradient_allreduce_op == "sum" and self.zero_optimization.stage == 3:
            log = key_log(info) or KeyLog()
            raise UsageError("gradient_allreduce_op 'sum' is not supported with ZeRO stage 3 "
                             "(nor by DeepSpeed)", where=log.where("gradient_allreduce_op"),
                             hint="use 'mean', or ZeRO stage 0-2")
        return self

    @model_validator(mode="after")
    def _accumulation_in_the_training_dtype(self, info: ValidationInfo) -> DeepShardConfig:
        wanted = self.data_types.grad_accum_dtype
        training = "bf16" if self.bf16.enabled else "fp16" if self.fp16.enabled else "fp32"
        if wanted is not None and wanted.lower() != training:
            log = key_log(info) or KeyLog()
            raise UsageError(f"gradients accumulate in the training dtype ({training}), "
                             f"not {wanted} (DeepSpeed refuses this mix at stage 0 too)",
                             where=log.where("data_types.grad_accum_dtype"),
                             hint=f"set it to {training!r} or remove it")
        return self

    @model_validator(mode="after")
    def _compile_pass_matches_the_stage(self, info: ValidationInfo) -> DeepShardConfig:
        passes, stage = self.compile.passes or [], self.zero_optimization.stage
        wrong = ("z1" if stage == 3 and "z1" in passes
                 else "z3" if stage < 3 and "z3" in passes else None)
        if wrong is not None:
            log = key_log(info) or KeyLog()
            raise UsageError(f"the DeepCompile pass {wrong!r} does not match ZeRO stage "
                             f"{stage} (DeepSpeed would partition differently)",
                             where=log.where("compile.passes"),
                             hint="deepshard's ZeRO stage is zero_optimization.stage: remove "
                                  f"{wrong!r} from compile.passes, or use "
                                  f"{'z3' if stage == 3 else 'z1'}")
        return self

    @model_validator(mode="after")
    def _one_half_precision(self, info: ValidationInfo) -> DeepShardConfig:
        if self.fp16.enabled and self.bf16.enabled:
            log = key_log(info) or KeyLog()
            raise UsageError("fp16 and bf16 are both enabled", where=log.where("bf16.enabled"),
                             hint="enable at most one of fp16.enabled and bf16.enabled")
        return self


def validate_config(data: dict[str, Any], *, origin: str = "<dict>"
                    ) -> tuple[DeepShardConfig, tuple[str, ...], tuple[str, ...]]:
    """Validate a raw config mapping.

    Returns:
        ``(config, unimplemented, unknown)``: the config, the dotted paths of keys
        DeepSpeed knows that deepshard ignores, and those of keys neither knows (each for
        one warning: DeepSpeed ignores unknown keys).

    Raises:
        UsageError: a misspelt key (with "did you mean"), a wrong type or value, or
            settings that contradict each other; ``where`` is ``<origin>: key.path``.
    """
    log = KeyLog(origin=origin)
    config = DeepShardConfig.model_validate(data, context={"keys": log})
    return config, tuple(log.unimplemented), tuple(log.unknown)


def find_auto_keys(data: Any, section: type[Section] = DeepShardConfig,
                   prefix: tuple[str, ...] = ()) -> list[str]:
    """Dotted paths of the keys of ``data`` whose value is the string "auto", along the
    schema: keys deepshard ignores (and unknown keys) are skipped."""
    if not isinstance(data, dict):
        return []
    found = []
    known = section.known_keys()
    for key, value in data.items():
        if key not in known:
            continue
        path = (*prefix, str(key))
        if isinstance(value, str) and value == "auto":
            found.append(".".join(path))
            continue
        child = section.section_of(key, data)
        if child is not None:
            found.extend(find_auto_keys(value, child, path))
    return found


__all__ = [
    "ActivationCheckpointingConfig", "BF16Config", "CheckpointConfig", "DeepShardConfig",
    "FP16Config", "FlopsProfilerConfig", "ParallelWriteConfig", "find_auto_keys",
    "validate_config",
]

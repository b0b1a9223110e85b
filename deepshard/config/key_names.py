"""DeepSpeed's config key names (``deepspeed.runtime.constants``): ``TRAIN_BATCH_SIZE`` is
``"train_batch_size"``, ``GRADIENT_CLIPPING_DEFAULT`` is ``1.0``, and so on for every name
of DeepSpeed 0.19.8's module, values included.

Scripts and libraries index a config dict with these (``ds_config[TRAIN_BATCH_SIZE]``). They
are data only: deepshard's own reading of the config is the typed schema in
:mod:`deepshard.config.schema`, which spells the same keys. ``*_FORMAT`` strings are short
examples of each key's form; ``SEQ_PARALLEL_COMMUNICATION_DATA_TYPE_DEFAULT`` is DeepSpeed's
value off NVIDIA GPUs (with NCCL 2.27.3 or newer DeepSpeed makes it None). The keys of the
dynamic loss scaler's arguments (``INITIAL_LOSS_SCALE``...) are DeepSpeed's
``runtime.fp16.loss_scaler`` names.
"""

from __future__ import annotations


class ValidationMode:
    """The values of ``checkpoint.tag_validation`` (DeepSpeed compares them upper-cased)."""

    WARN = "WARN"
    IGNORE = "IGNORE"
    FAIL = "FAIL"


ROUTE_TRAIN = "train"
ROUTE_EVAL = "eval"
ROUTE_PREDICT = "predict"
ROUTE_ENCODE = "encode"
TRAIN_BATCH_SIZE = "train_batch_size"
TRAIN_BATCH_SIZE_DEFAULT = None
OPTIMIZER = "optimizer"
OPTIMIZER_TYPE_DEFAULT = None
OPTIMIZER_PARAMS = "params"
TYPE = "type"
LEGACY_FUSION = "legacy_fusion"
LEGACY_FUSION_DEFAULT = False
SCHEDULER = "scheduler"
SCHEDULER_TYPE_DEFAULT = None
SCHEDULER_PARAMS = "params"
MAX_GRAD_NORM = "max_grad_norm"
ZERO_ALLOW_UNTESTED_OPTIMIZER = "zero_allow_untested_optimizer"
ZERO_ALLOW_UNTESTED_OPTIMIZER_DEFAULT = False
ZERO_FORCE_DS_CPU_OPTIMIZER = "zero_force_ds_cpu_optimizer"
ZERO_FORCE_DS_CPU_OPTIMIZER_DEFAULT = True
STEPS_PER_PRINT = "steps_per_print"
STEPS_PER_PRINT_DEFAULT = None
TRAIN_MICRO_BATCH_SIZE_PER_GPU = "train_micro_batch_size_per_gpu"
TRAIN_MICRO_BATCH_SIZE_PER_GPU_DEFAULT = None
GRADIENT_ACCUMULATION_FORMAT = (
    '"gradient_accumulation_steps": <int> micro-batches per optimizer step')
GRADIENT_ACCUMULATION_STEPS = "gradient_accumulation_steps"
GRADIENT_ACCUMULATION_STEPS_DEFAULT = None
MANAGED_GRADIENT_ACCUMULATION = "managed_gradient_accumulation"
MANAGED_GRADIENT_ACCUMULATION_DEFAULT = True
BFLOAT16_FORMAT = '"bf16": {"enabled": true} trains in bf16 mixed precision'
BFLOAT16 = "bf16"
BFLOAT16_OLD = "bfloat16"
BFLOAT16_ENABLED = "enabled"
BFLOAT16_ENABLED_DEFAULT = False
CHECK_OVERFLOW = "check_overflow"
BFLOAT16_CHECK_OVERFLOW_DEFAULT = False
BFLOAT16_IMMEDIATE_GRAD_UPDATE = "immediate_grad_update"
BFLOAT16_IMMEDIATE_GRAD_UPDATE_DEFAULT = True
BFLOAT16_MASTER_WEIGHTS_AND_GRADS = "bf16_master_weights_and_grads"
BFLOAT16_MASTER_WEIGHTS_AND_GRADS_DEFAULT = False
BFLOAT16_OPTIMIZER_STATES = "bf16_optimizer_states"
BFLOAT16_OPTIMIZER_STATES_DEFAULT = False
DDP_BFLOAT16 = "ddp_bf16"
FP16_FORMAT = ('"fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 16, '
               '"loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}')
FP16 = "fp16"
FP16_ENABLED = "enabled"
FP16_ENABLED_DEFAULT = False
FP16_LOSS_SCALE = "loss_scale"
FP16_LOSS_SCALE_DEFAULT = 0
FP16_AUTO_CAST = "auto_cast"
FP16_AUTO_CAST_DEFAULT = False
FP16_INITIAL_SCALE_POWER = "initial_scale_power"
FP16_INITIAL_SCALE_POWER_DEFAULT = 16
FP16_LOSS_SCALE_WINDOW = "loss_scale_window"
FP16_LOSS_SCALE_WINDOW_DEFAULT = 1000
FP16_HYSTERESIS = "hysteresis"
FP16_HYSTERESIS_DEFAULT = 2
FP16_CONSECUTIVE_HYSTERESIS = "consecutive_hysteresis"
FP16_CONSECUTIVE_HYSTERESIS_DEFAULT = False
FP16_MIN_LOSS_SCALE = "min_loss_scale"
FP16_MIN_LOSS_SCALE_DEFAULT = 1
FP16_MASTER_WEIGHTS_AND_GRADS = "fp16_master_weights_and_grads"
FP16_MASTER_WEIGHTS_AND_GRADS_DEFAULT = False
TORCH_AUTOCAST_FORMAT = '"torch_autocast": {"enabled": true, "dtype": "bfloat16"}'
TORCH_AUTOCAST = "torch_autocast"
TORCH_AUTOCAST_ENABLED = "enabled"
TORCH_AUTOCAST_ENABLED_DEFAULT = False
TORCH_AUTOCAST_DTYPE = "dtype"
TORCH_AUTOCAST_LOWER_PRECISION_SAFE_MODULES = "lower_precision_safe_modules"
GRADIENT_CLIPPING_FORMAT = '"gradient_clipping": <float> global gradient norm cap (0: off)'
GRADIENT_CLIPPING = "gradient_clipping"
GRADIENT_CLIPPING_DEFAULT = 1.0
COMMUNICATION_DATA_TYPE_FORMAT = '"communication_data_type": "fp32" | "fp16" | "bf16"'
COMMUNICATION_DATA_TYPE = "communication_data_type"
COMMUNICATION_DATA_TYPE_DEFAULT = None
SEQ_PARALLEL_COMMUNICATION_DATA_TYPE_FORMAT = (
    '"seq_parallel_communication_data_type": "fp32" | "fp16" | "bf16"')
SEQ_PARALLEL_COMMUNICATION_DATA_TYPE = "seq_parallel_communication_data_type"
SEQ_PARALLEL_COMMUNICATION_DATA_TYPE_DEFAULT = "fp32"
PRESCALE_GRADIENTS_FORMAT = '"prescale_gradients": <bool> divide before the reduction'
PRESCALE_GRADIENTS = "prescale_gradients"
PRESCALE_GRADIENTS_DEFAULT = False
GRADIENT_PREDIVIDE_FACTOR_FORMAT = (
    '"gradient_predivide_factor": <float> divisor before the reduction')
GRADIENT_PREDIVIDE_FACTOR = "gradient_predivide_factor"
GRADIENT_PREDIVIDE_FACTOR_DEFAULT = 1.0
GRADIENT_ALLREDUCE_OP_FORMAT = '"gradient_allreduce_op": "mean" | "sum"'
GRADIENT_ALLREDUCE_OP = "gradient_allreduce_op"
GRADIENT_ALLREDUCE_OP_MEAN = "mean"
GRADIENT_ALLREDUCE_OP_SUM = "sum"
GRADIENT_ALLREDUCE_OP_DEFAULT = GRADIENT_ALLREDUCE_OP_MEAN
GRADIENT_ALLREDUCE_OP_SUPPORTED = (GRADIENT_ALLREDUCE_OP_MEAN, GRADIENT_ALLREDUCE_OP_SUM)
DISABLE_ALLGATHER_FORMAT = '"disable_allgather": <bool>'
DISABLE_ALLGATHER = "disable_allgather"
DISABLE_ALLGATHER_DEFAULT = False
DUMP_STATE_FORMAT = '"dump_state": <bool> print the engine state after initialization'
DUMP_STATE = "dump_state"
DUMP_STATE_DEFAULT = False
DISABLE_PYTHON_GC_FORMAT = '"disable_python_gc": <int> collect garbage every N steps'
DISABLE_PYTHON_GC = "disable_python_gc"
DISABLE_PYTHON_GC_DEFAULT = False
VOCABULARY_SIZE_FORMAT = '"vocabulary_size": <int>'
VOCABULARY_SIZE = "vocabulary_size"
VOCABULARY_SIZE_DEFAULT = None
WALL_CLOCK_BREAKDOWN_FORMAT = '"wall_clock_breakdown": <bool> time forward, backward and step'
WALL_CLOCK_BREAKDOWN = "wall_clock_breakdown"
WALL_CLOCK_BREAKDOWN_DEFAULT = False
MEMORY_BREAKDOWN = "memory_breakdown"
MEMORY_BREAKDOWN_DEFAULT = False
CHECKPOINT = "checkpoint"
CHECKPOINT_TAG_VALIDATION = "tag_validation"
CHECKPOINT_TAG_VALIDATION_DEFAULT = ValidationMode.WARN
CHECKPOINT_TAG_VALIDATION_MODES = (ValidationMode.WARN, ValidationMode.IGNORE, ValidationMode.FAIL)
LOAD_UNIVERSAL_CHECKPOINT = "load_universal"
LOAD_UNIVERSAL_CHECKPOINT_DEFAULT = False
USE_NODE_LOCAL_STORAGE_CHECKPOINT = "use_node_local_storage"
USE_NODE_LOCAL_STORAGE_CHECKPOINT_DEFAULT = False
CHECKPOINT_PARALLEL_WRITE = "parallel_write"
CHECKPOINT_PARALLEL_WRITE_PIPELINE_STAGE = "pipeline_stage"
CHECKPOINT_PARALLEL_WRITE_PIPELINE_STAGE_DEFAULT = False
DATA_TYPES = "data_types"
GRAD_ACCUM_DTYPE = "grad_accum_dtype"
GRAD_ACCUM_DTYPE_DEFAULT = None
PARAM_DTYPE = "param_dtype"
PARAM_DTYPE_DEFAULT = None
BUFFER_DTYPE = "buffer_dtype"
BUFFER_DTYPE_DEFAULT = None
KEEP_IN_FP32_MODULES = "keep_in_fp32_modules"
KEEP_IN_FP32_MODULES_DEFAULT = "auto"
DATALOADER_DROP_LAST_FORMAT = '"dataloader_drop_last": <bool> drop the last partial batch'
DATALOADER_DROP_LAST = "dataloader_drop_last"
DATALOADER_DROP_LAST_DEFAULT = False
PIPE_REPLICATED = "ds_pipe_replicated"
DATA_PARALLEL_GROUP = "data_parallel_group"
GLOBAL_RANK = "global_rank"
USE_DATA_BEFORE_EXPERT_PARALLEL = "use_data_before_expert_parallelism"
USE_DATA_BEFORE_EXPERT_PARALLEL_DEFAULT = False
LOG_LEVEL = "log_level"
LOG_LEVEL_DEFAULT = None


# the dynamic loss scaler's arguments (deepspeed.runtime.fp16.loss_scaler)
INITIAL_LOSS_SCALE = "init_scale"
SCALE_WINDOW = "scale_window"
DELAYED_SHIFT = "delayed_shift"
CONSECUTIVE_HYSTERESIS = "consecutive_hysteresis"
MIN_LOSS_SCALE = "min_scale"

"""``HfTrainerDeepShardConfig``: the ``"auto"`` values of a DeepSpeed config filled from
``TrainingArguments``, exactly as transformers' ``HfTrainerDeepSpeedConfig`` fills them.

Two passes, as in transformers: :meth:`~HfTrainerDeepShardConfig.trainer_config_process`
when the ``TrainingArguments`` are built (batch sizes, clipping, optimizer and scheduler
hyperparameters, fp16/bf16), :meth:`~HfTrainerDeepShardConfig.trainer_config_finalize` when
the model and the number of steps are known (hidden-size-based ZeRO buckets, the
scheduler's step counts). A value that is not ``"auto"`` and disagrees with the
``TrainingArguments`` is collected; the finalize pass raises them all as one
:class:`~deepshard.errors.UsageError` line (transformers raises a multi-line ``ValueError``).
:meth:`~HfTrainerDeepShardConfig.fill_accelerate_defaults` then fills what Accelerate's
``_prepare_deepspeed`` fills after the Trainer. Pure: no process group, no engine.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from deepshard.errors import UsageError
from deepshard.integrations.hf_config import HfDeepShardConfig

# zero_optimization keys sized from the model's hidden size when "auto" (transformers')
HIDDEN_SIZE_KEYS = ("zero_optimization.reduce_bucket_size",
                    "zero_optimization.stage3_prefetch_bucket_size",
                    "zero_optimization.stage3_param_persistence_threshold")


@dataclass(frozen=True)
class Mismatch:
    """A config value that is not ``"auto"`` and differs from the ``TrainingArguments``."""

    key: str
    """Dotted key path in the DeepSpeed config."""
    config_value: Any
    hf_field: str
    """The ``TrainingArguments`` field (or what transformers computes from them)."""
    hf_value: Any

    def __str__(self) -> str:
        return (f"{self.key}={self.config_value!r} but TrainingArguments "
                f"{self.hf_field}={self.hf_value!r}")


class HfTrainerDeepShardConfig(HfDeepShardConfig):
    """A DeepSpeed config whose ``"auto"`` values the Trainer fills (module docstring).

    Created by :class:`deepshard.integrations.hf_trainer.TrainingArguments` and kept alive
    on it as ``args.hf_deepspeed_config`` (so that models built after it load partitioned
    at ZeRO stage 3).

    Args:
        config_file_or_dict: a dict (deep-copied) or the path of a JSON/YAML config.
    """

    def __init__(self, config_file_or_dict: Any):
        super().__init__(config_file_or_dict)
        self._dtype: Any = None
        self.sequence_parallel_size = 1
        """Ranks sharing each batch's tokens (known after ``trainer_config_process``)."""
        self.mismatches: list[Mismatch] = []
        self._processed: tuple[dict, list[Mismatch]] | None = None

    def dtype(self):
        """The training dtype the config asks for (known after ``trainer_config_process``)."""
        if self._dtype is None:
            raise UsageError("the config's dtype is not known yet",
                             where="HfTrainerDeepShardConfig",
                             hint="call trainer_config_process(args) first")
        return self._dtype

    def is_auto(self, ds_key_long: str) -> bool:
        """Whether the value at the dotted path is the string ``"auto"``."""
        return self.get_value(ds_key_long) == "auto"

    def fill_match(self, ds_key_long: str, hf_val: Any, hf_key: str | None = None,
                   must_match: bool = True) -> None:
        """Replace an ``"auto"`` value by ``hf_val``; otherwise, with ``must_match``, record
        a set value that differs from it. A missing key (or parent) is left missing."""
        node, key = self.find_config_node(ds_key_long)
        if node is None:
            return
        if node.get(key) == "auto":
            node[key] = hf_val
            return
        if not must_match:
            return
        value = node.get(key)
        if value is not None and value != hf_val:
            self.mismatches.append(Mismatch(ds_key_long, value, hf_key or ds_key_long, hf_val))

    def fill_only(self, ds_key_long: str, hf_val: Any, hf_key: str | None = None) -> None:
        """Replace an ``"auto"`` value by ``hf_val``; a set value stays, whatever it is."""
        self.fill_match(ds_key_long, hf_val, hf_key, must_match=False)

    # the two passes -------------------------------------------------------------------
    def trainer_config_process(self, args, auto_find_batch_size: bool = False) -> None:
        """Fill from ``args`` (``TrainingArguments``) what is known before the model: as
        transformers' pass of the same name, key by key; besides, ``sequence_parallel_size``
        from ``args.parallelism_config.sp_size`` (HF's switch for ALST/Ulysses)."""
        self.sequence_parallel_size = self._fill_sequence_parallel(args)
        self._fill_batch(args, auto_find_batch_size)
        self.fill_match("gradient_clipping", args.max_grad_norm, "max_grad_norm")
        self._fill_optimizer(args)
        if args.save_on_each_node:
            self.config.setdefault("checkpoint", {})
            self.config["checkpoint"]["use_node_local_storage"] = args.save_on_each_node
        self.fill_match("fp16.enabled", args.fp16 or args.fp16_full_eval, "fp16|fp16_full_eval")
        self.fill_match("bf16.enabled", args.bf16 or args.bf16_full_eval, "bf16|bf16_full_eval")
        self._dtype = self._config_dtype()
        self._processed = (copy.deepcopy(self.config), list(self.mismatches))

    def _fill_sequence_parallel(self, args) -> int:
        """``"auto"`` or a set value checked against ``parallelism_config.sp_size``; the
        key written when only ``parallelism_config`` asks for sequence parallelism."""
        pc = getattr(args, "parallelism_config", None)
        if pc is None:
            self.fill_only("sequence_parallel_size", 1)
        else:
            check_parallelism_config(pc)
            self.fill_match("sequence_parallel_size", pc.sp_size, "parallelism_config.sp_size")
            if pc.sp_size > 1:
                self.config.setdefault("sequence_parallel_size", pc.sp_size)
        size = self.config.get("sequence_parallel_size", 1)
        return size if isinstance(size, int) and size > 0 else 1

    def _fill_batch(self, args, auto_find_batch_size: bool) -> None:
        # DeepSpeed: train_batch_size = replicas * micro * accumulation, where a replica is
        # a sequence-parallel group (as Accelerate fixes it for ALST)
        micro, gas = args.per_device_train_batch_size, args.gradient_accumulation_steps
        total = max(1, args.world_size // self.sequence_parallel_size) * micro * gas
        self.fill_match("train_micro_batch_size_per_gpu", args.per_device_train_batch_size,
                        "per_device_train_batch_size", not auto_find_batch_size)
        self.fill_match("gradient_accumulation_steps", args.gradient_accumulation_steps,
                        "gradient_accumulation_steps")
        self.fill_match("train_batch_size", total, "train_batch_size (calculated)",
                        not auto_find_batch_size)

    def _fill_optimizer(self, args) -> None:
        self.fill_match("optimizer.params.lr", args.learning_rate, "learning_rate")
        self.fill_match("optimizer.params.betas", [args.adam_beta1, args.adam_beta2],
                        "adam_beta1+adam_beta2")
        self.fill_match("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
        self.fill_match("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
        self.fill_only("scheduler.params.warmup_min_lr", 0)  # not a trainer argument
        self.fill_match("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")

    def _config_dtype(self):
        import torch

        if self.is_true("bf16.enabled"):
            return torch.bfloat16
        if self.is_true("fp16.enabled"):
            return torch.float16
        return torch.float32

    def trainer_config_finalize(self, args, model, num_training_steps: int) -> None:
        """Fill what needs the model and the step count (ZeRO buckets from the hidden size,
        the scheduler's ``total_num_steps`` and ``warmup_num_steps``), then raise every
        mismatch recorded by either pass. Each call starts again from what
        ``trainer_config_process`` left (``self.config`` is updated in place), so that an
        engine built for ``evaluate()`` (0 steps) and one for ``train()`` can follow each
        other; transformers fills its config once and would then see its own 0 as a
        mismatch.

        Raises:
            UsageError: one line naming each mismatched key and value with the
                ``TrainingArguments`` field and value; or "auto" bucket sizes for a model
                whose config has no hidden size.
        """
        self._restore_processed()
        if any(self.is_auto(key) for key in HIDDEN_SIZE_KEYS):
            hidden = model_hidden_size(model, [k for k in HIDDEN_SIZE_KEYS if self.is_auto(k)])
            self.fill_only("zero_optimization.reduce_bucket_size", hidden * hidden)
            if self.is_zero3():
                self.fill_only("zero_optimization.stage3_prefetch_bucket_size",
                               int(0.9 * hidden * hidden))
                self.fill_only("zero_optimization.stage3_param_persistence_threshold",
                               10 * hidden)
        self.fill_match("scheduler.params.total_num_steps", num_training_steps,
                        "num_training_steps (calculated)")
        # DeepSpeed >= 0.19.6 rejects a non-positive warmup_num_steps: transformers keeps it >= 1
        self.fill_match("scheduler.params.warmup_num_steps",
                        max(1, args.get_warmup_steps(num_training_steps)), "warmup_steps")
        self.raise_mismatches()

    def _restore_processed(self) -> None:
        if self._processed is None:
            return
        config, mismatches = self._processed
        self.config.clear()
        self.config.update(copy.deepcopy(config))
        self.mismatches = list(mismatches)

    def raise_mismatches(self) -> None:
        """Raise the recorded mismatches as one :class:`UsageError` line (none: nothing)."""
        if not self.mismatches:
            return
        found = "; ".join(str(m) for m in self.mismatches)
        keys = ", ".join(m.key for m in self.mismatches)
        raise UsageError(f"DeepSpeed config values disagree with the TrainingArguments: {found}",
                         where=self.origin,
                         hint=f'set {keys} to "auto" in the config (the Trainer fills them '
                              "from the TrainingArguments), or make both the same")

    def fill_accelerate_defaults(self, model, world_size: int) -> None:
        """Fill the ``"auto"`` values transformers leaves and Accelerate's
        ``_prepare_deepspeed`` fills (never checked against anything): clipping 1.0, the
        batch pair from the micro-batch, every hidden-size bucket at any stage, and
        ``stage3_gather_16bit_weights_on_model_save`` false."""
        self.fill_only("gradient_clipping", 1.0)
        self.fill_only("zero_optimization.stage3_gather_16bit_weights_on_model_save", False)
        micro = self.get_value("train_micro_batch_size_per_gpu")
        gas = self.get_value("gradient_accumulation_steps")
        if isinstance(micro, int) and isinstance(gas, int):
            replicas = max(1, world_size // self.sequence_parallel_size)
            self.fill_only("train_batch_size", micro * gas * replicas)
        autos = [k for k in HIDDEN_SIZE_KEYS if self.is_auto(k)]
        if autos:
            hidden = model_hidden_size(model, autos)
            self.fill_only(HIDDEN_SIZE_KEYS[0], hidden * hidden)
            self.fill_only(HIDDEN_SIZE_KEYS[1], int(0.9 * hidden * hidden))
            self.fill_only(HIDDEN_SIZE_KEYS[2], 10 * hidden)


def check_parallelism_config(pc) -> None:
    """``TrainingArguments.parallelism_config`` under ``deepspeed=``: only its sequence
    parallelism (``sp_size``, ``sp_backend="deepspeed"``) applies; data parallelism is
    what the sequence groups leave, as with DeepSpeed.

    Raises:
        UsageError: tensor or context parallelism asked for there.
    """
    asked = {k: getattr(pc, k, 1) for k in ("tp_size", "cp_size")}
    asked = {k: v for k, v in asked.items() if v and v > 1}
    if asked:
        found = ", ".join(f"{k}={v}" for k, v in asked.items())
        raise UsageError(f"parallelism_config asks for {found}, which deepshard's Trainer "
                         "does not take from it", where="TrainingArguments.parallelism_config",
                         hint="keep only sp_size there; tensor parallelism is the config's "
                              "tensor_parallel.autotp_size")


def model_hidden_size(model, auto_keys: list[str]) -> int:
    """The hidden size transformers sizes "auto" ZeRO buckets from: ``config.hidden_size``,
    the largest of ``hidden_sizes``, or the same of ``config.text_config``.

    Raises:
        UsageError: the model's config has none of them (naming ``auto_keys``).
    """
    config = getattr(model, "config", None)
    for node in (config, getattr(config, "text_config", None)):
        if node is None:
            continue
        if getattr(node, "hidden_size", None) is not None:
            return int(node.hidden_size)
        if getattr(node, "hidden_sizes", None):
            return int(max(node.hidden_sizes))
    raise UsageError("the model's config has neither hidden_size nor hidden_sizes, so "
                     f"{', '.join(auto_keys)} cannot be filled from it",
                     where=", ".join(auto_keys),
                     hint='replace "auto" for these keys by integers of your choice')

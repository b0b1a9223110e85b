"""DeepSpeed's engine getters: config flags, progress counters and optimizer readings,
as the scripts and integrations that drive a DeepSpeed engine call them.

:class:`EngineGetters` is a mixin of :class:`~deepshard.runtime.engine.DeepShardEngine`;
it reads only ``self._config``, ``self.counters``, ``self.optimizer``,
``self.loss_scaler`` and the last step's results, and changes nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from deepshard.config.given import GivenConfig

if TYPE_CHECKING:
    from deepshard.config.schema import DeepShardConfig
    from deepshard.runtime.engine import Counters
    from deepshard.runtime.engine_monitor import EngineMonitor
    from deepshard.runtime.zero.spec import ZeroSpec


class EngineGetters:
    """The read-only part of DeepSpeed's engine API (see the module docstring)."""

    _config: DeepShardConfig
    _given: GivenConfig
    _zero: ZeroSpec
    counters: Counters
    optimizer: Any  # torch.optim.Optimizer | None
    loss_scaler: Any  # deepshard.runtime.loss_scaler's scaler, or None
    _grad_norm: float | None
    _step_applied: bool
    _monitor: EngineMonitor

    if TYPE_CHECKING:
        def save_16bit_model(self, save_dir: Any, save_filename: str = "pytorch_model.bin",
                             exclude_frozen_parameters: bool = False) -> bool: ...

    @property
    def config(self) -> GivenConfig:
        """DeepSpeed's ``engine.config``: the config as given, a ``dict``
        (``engine.config.get("zero_optimization", {})``), whose attributes are the
        validated config's (``engine.config.zero_optimization.stage``)."""
        return self._given

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken (including fp16-skipped ones, as in DeepSpeed)."""
        return self.counters.global_steps

    @property
    def micro_steps(self) -> int:
        """Micro-batches seen."""
        return self.counters.micro_steps

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because of fp16 overflow."""
        return self.counters.skipped_steps

    @property
    def global_samples(self) -> int:
        """Samples consumed by all ranks."""
        return self.counters.global_samples

    def train_batch_size(self) -> int:
        return cast(int, self._config.train_batch_size)  # resolved by initialize()

    def train_micro_batch_size_per_gpu(self) -> int:
        return cast(int, self._config.train_micro_batch_size_per_gpu)  # resolved by initialize()

    def gradient_accumulation_steps(self) -> int:
        return cast(int, self._config.gradient_accumulation_steps)  # resolved by initialize()

    def fp16_enabled(self) -> bool:
        return self._config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self._config.bf16.enabled

    def zero_optimization_stage(self) -> int:
        return self._zero.stage

    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    def memory_breakdown(self) -> bool:
        """DeepSpeed's config flag getter (``memory_breakdown``); deepshard does not log it."""
        return False

    def get_lr(self) -> list[float]:
        """Learning rate of every param group."""
        return [g["lr"] for g in self.optimizer.param_groups] if self.optimizer else []

    def get_mom(self) -> list:
        """Momentum (``betas`` for Adam-style groups, ``momentum`` for SGD) per param group."""
        if not self.optimizer:
            return []
        return [g.get("betas", g.get("momentum")) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """Norm of the last step's gradients (before clipping; None before the first)."""
        return self._grad_norm

    def was_step_applied(self) -> bool:
        """False when the last boundary's optimizer step was skipped (fp16 overflow)."""
        return self._step_applied

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16)."""
        return self.loss_scaler.loss_scale if self.loss_scaler else 1.0

    # -- ZeRO and precision flags -----------------------------------------------------
    def zero_optimization(self) -> bool:
        """ZeRO is on (stage 1-3)."""
        return self._zero.shards_optimizer

    def zero_optimization_partition_gradients(self) -> bool:
        """Gradients are sharded (stage 2-3)."""
        return self._zero.shards_gradients

    def zero_optimization_partition_weights(self) -> bool:
        """Parameters are sharded (stage 3)."""
        return self._zero.shards_parameters

    def zero_offload_optimizer(self):
        """The ``offload_optimizer`` section, or ``None``."""
        return self._config.zero_optimization.offload_optimizer

    def zero_offload_param(self):
        """The ``offload_param`` section, or ``None``."""
        return self._config.zero_optimization.offload_param

    def zero_cpu_offload(self) -> bool:
        """The optimizer state lives on the CPU."""
        offload = self._config.zero_optimization.offload_optimizer
        return offload is not None and offload.device == "cpu"

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """``stage3_gather_16bit_weights_on_model_save`` (what ``save_16bit_model`` needs
        at stage 3)."""
        return self._config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    def amp_enabled(self) -> bool:
        """NVIDIA apex AMP: never (deepshard has fp16/bf16 sections instead)."""
        return False

    def dynamic_loss_scale(self) -> bool:
        """fp16 with a dynamic loss scale (``fp16.loss_scale`` 0)."""
        return self._config.fp16.enabled and self._config.fp16.loss_scale == 0

    def steps_per_print(self) -> int | None:
        return self._config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        """Whether the engine times forward, backward and step (the config's flag)."""
        return self._config.wall_clock_breakdown

    # -- data efficiency (DeepSpeed's dicts of the section: deepshard.data_efficiency) ----
    def data_efficiency_enabled(self) -> bool:
        """``data_efficiency.enabled``."""
        return self._config.data_efficiency.enabled

    def data_efficiency_config(self) -> dict[str, Any]:
        """The ``data_efficiency`` section as DeepSpeed's dict (defaults filled in)."""
        return self._config.data_efficiency.as_deepspeed()

    def data_sampling_enabled(self) -> bool:
        """``data_efficiency.data_sampling.enabled``."""
        return self._config.data_efficiency.data_sampling.enabled

    def data_sampling_config(self) -> dict[str, Any]:
        """``data_efficiency.data_sampling`` as DeepSpeed's dict."""
        return self.data_efficiency_config()["data_sampling"]

    def curriculum_learning_enabled(self) -> bool:
        """Whether the curriculum sampler feeds ``initialize(training_data=...)``'s loader."""
        return self._config.data_efficiency.data_sampling.curriculum_learning.enabled

    def curriculum_learning_config(self) -> dict[str, Any]:
        """``data_efficiency.data_sampling.curriculum_learning`` as DeepSpeed's dict."""
        return self.data_sampling_config()["curriculum_learning"]

    def random_ltd_enabled(self) -> bool:
        """Whether random-LTD drops tokens in the configured layers."""
        return self._config.data_efficiency.data_routing.random_ltd.enabled

    def random_ltd_config(self) -> dict[str, Any]:
        """``data_efficiency.data_routing.random_ltd`` as DeepSpeed's dict."""
        return self.data_efficiency_config()["data_routing"]["random_ltd"]

    def get_wall_clock_timers(self) -> dict[str, float]:
        """The last optimizer step's times in ms (DeepSpeed's global timers: ``fwd``,
        ``bwd``, ``bwd_inner``, ``bwd_allreduce``, ``step``; empty without
        ``wall_clock_breakdown``)."""
        return self._monitor.wall_clock_timers()

    @property
    def monitor(self):
        """The engine's :class:`~deepshard.monitor.monitor.MonitorMaster` (DeepSpeed's
        ``engine.monitor``: ``.enabled``, ``.write_events(events)`` for a script's own)."""
        return self._monitor.master

    def save_fp16_model(self, save_dir, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's older name of ``save_16bit_model``."""
        return self.save_16bit_model(save_dir, save_filename)

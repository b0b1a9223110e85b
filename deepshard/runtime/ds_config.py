"""DeepSpeed's ``deepspeed.runtime.config.DeepSpeedConfig``: a config read and checked
outside an engine, under DeepSpeed's attribute names.

Monitors, batch-size tools and several libraries build one from a dict (``DeepSpeedConfig(
{"train_batch_size": 8, ...})``) and read ``train_micro_batch_size_per_gpu``,
``zero_optimization_stage``, ``bfloat16_config.enabled`` and the like. This one validates
with deepshard's loader (so a mistake is the same one-line error, a
:class:`~deepshard.errors.UsageError`, which is ``DeepSpeedConfigError`` under the compat
path) and resolves the batch triad against the data-parallel size: ``mpu``'s, else the
process group's, else 1, as DeepSpeed does. The sections are deepshard's validated ones.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from deepshard.config import load_config


class DeepSpeedConfig:
    """A validated config with DeepSpeed's attribute names (see the module docstring).

    Args:
        config: a dict or a path (DeepSpeed's JSON dialect, or YAML).
        mpu: optional; its ``get_data_parallel_world_size()`` is the world size the batch
            triad is resolved against.
        mesh_device: accepted for DeepSpeed's signature; not used.
    """

    def __init__(self, config: Any, mpu: Any = None, mesh_device: Any = None):
        del mesh_device
        if mpu is not None:
            self.world_size = int(mpu.get_data_parallel_world_size())
        else:
            self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0
        loaded = load_config(config, world_size=self.world_size)
        self._param_dict, self.config = loaded.given, loaded.config
        c = self.config
        self.train_batch_size = c.train_batch_size
        self.train_micro_batch_size_per_gpu = c.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = c.gradient_accumulation_steps
        self.zero_config = c.zero_optimization
        self.zero_optimization_stage = c.zero_optimization.stage
        self.zero_enabled = self.zero_optimization_stage > 0
        self.bfloat16_config = c.bf16
        self.float16_config = c.fp16
        self.gradient_clipping = c.gradient_clipping
        self.prescale_gradients = c.prescale_gradients
        self.gradient_predivide_factor = c.gradient_predivide_factor
        self.steps_per_print = c.steps_per_print
        self.wall_clock_breakdown = c.wall_clock_breakdown
        self.communication_data_type = c.communication_data_type
        self.optimizer_name = c.optimizer.type if c.optimizer is not None else None
        self.optimizer_params = (c.optimizer.params.model_dump() if c.optimizer is not None
                                 else None)
        self.scheduler_name = c.scheduler.type if c.scheduler is not None else None
        self.scheduler_params = (c.scheduler.params.model_dump() if c.scheduler is not None
                                 else None)
        self.checkpoint_config = c.checkpoint
        validation = c.checkpoint.tag_validation.lower()
        self.checkpoint_tag_validation_enabled = validation != "ignore"
        self.checkpoint_tag_validation_fail = validation == "fail"
        self.monitor_config = c.monitor_config
        self.flops_profiler_config = c.flops_profiler
        self.activation_checkpointing_config = c.activation_checkpointing

    def print(self, name: str) -> None:
        """DeepSpeed's ``DeepSpeedConfig.print``: the config, one key per line."""
        print(f"{name}:")
        for key, value in sorted(self._param_dict.items()):
            print(f"  {key} {'.' * max(1, 28 - len(key))} {value}")

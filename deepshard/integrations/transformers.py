"""deepshard for HF Transformers users: what ``transformers.integrations.deepspeed`` and
the DeepSpeed path of ``Trainer`` give DeepSpeed users, over deepshard's engine.

- :class:`HfDeepShardConfig`: while alive with stage 3, ``from_pretrained`` and
  ``from_config`` build models already partitioned, each rank reading only its slices of
  the safetensors files (:mod:`.hf_loading`);
- :class:`TrainingArguments` and :class:`Trainer`: transformers' own, with
  ``deepspeed=`` driving deepshard ("auto" values filled as transformers fills them,
  :mod:`.hf_auto`; :mod:`.hf_trainer`);
- :func:`save_pretrained`: the HF format from any ZeRO stage (:mod:`.hf_save`).

A script changes only its import: ``from deepshard.integrations.transformers import
Trainer, TrainingArguments``.
"""

from __future__ import annotations

from deepshard.integrations.hf_auto import HfTrainerDeepShardConfig
from deepshard.integrations.hf_config import HfDeepShardConfig
from deepshard.integrations.hf_loading import active_config
from deepshard.integrations.hf_save import consolidated_16bit_state_dict, save_pretrained
from deepshard.integrations.hf_trainer import Trainer, TrainingArguments


def is_deepshard_zero3_enabled() -> bool:
    """transformers' ``is_deepspeed_zero3_enabled()``: whether a live
    :class:`HfDeepShardConfig` asks for stage 3."""
    config = active_config()
    return config is not None and config.is_zero3()


__all__ = ["HfDeepShardConfig", "HfTrainerDeepShardConfig", "Trainer", "TrainingArguments",
           "consolidated_16bit_state_dict", "is_deepshard_zero3_enabled", "save_pretrained"]

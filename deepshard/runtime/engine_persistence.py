"""The engine's persistence and data API (DeepSpeed's names), kept apart from the training
loop of :mod:`.engine`: checkpoints (:class:`EnginePersistence`, over
:mod:`deepshard.runtime.checkpoint.engine_io`) and the loaders (:class:`EngineData`).
Mixins of :class:`~deepshard.runtime.engine.DeepShardEngine`; they use its public state."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from deepshard.runtime.checkpoint import engine_io

if TYPE_CHECKING:
    from deepshard.runtime.extensions import EngineFeature, Extensions


class EnginePersistence:
    """Checkpoints and model exports."""

    _extensions: Extensions

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False) -> bool:
        """Save model, optimizer, scheduler, loss scaler, RNG and ``client_state`` atomically.

        Collective: every rank must call it. ``tag`` defaults to ``global_step<N>``.
        ``exclude_frozen_parameters`` leaves out parameters that do not require grad (a
        LoRA model's base), as DeepSpeed does: load such a checkpoint with
        ``load_module_strict=False`` into a model that has them already. A failed write
        (full disk, no permission) raises a :class:`~deepshard.errors.UsageError` on every
        rank naming the path; the previous checkpoint stays loadable.
        """
        return engine_io.save_checkpoint(self, save_dir, tag, client_state, save_latest,
                                         exclude_frozen_parameters)

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's: rank 0 writes the module's state dict (its training dtype) to
        ``save_dir/save_filename``, atomically. At ZeRO stage 3 the parameters are gathered
        for it when ``stage3_gather_16bit_weights_on_model_save`` is set; otherwise nothing
        is saved and False returned, as in DeepSpeed; they are gathered one flat group at
        a time, so the whole model is never held by any rank but rank 0's CPU copy.
        Collective."""
        return engine_io.save_16bit_model(self, save_dir, save_filename,
                                          exclude_frozen_parameters)

    def save_pretrained(self, save_directory, **kwargs) -> None:
        """The model in the HF format (sharded safetensors with their index,
        ``config.json``, generation config; a PEFT model's adapter), consolidated from any
        ZeRO stage, the ranks writing shards in parallel: see
        :func:`deepshard.integrations.hf_save.save_pretrained` for the keyword arguments.
        Collective; needs transformers. Implemented by the ``hf`` feature
        (:mod:`deepshard.integrations.extension`)."""
        self._extensions.export("save_pretrained")(self, save_directory, **kwargs)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                             ) -> dict:
        """DeepSpeed's name (what HF's Trainer and Accelerate call): the module's whole
        state dict on rank 0 (empty elsewhere), at any stage. Collective."""
        return self._extensions.export("consolidated_16bit_state_dict")(
            self, exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True,
                        load_optimizer_states=True, load_lr_scheduler_states=True,
                        load_module_only=False):
        """Restore a checkpoint of any stage and world size (model-parallel ones: of the
        same layout); returns ``(path, client_state)``, or ``(None, None)`` when
        ``load_dir`` holds no complete checkpoint (as DeepSpeed does)."""
        return engine_io.load_checkpoint(self, load_dir, tag, load_module_strict,
                                         load_optimizer_states, load_lr_scheduler_states,
                                         load_module_only)


class EngineData:
    """DeepSpeed's data loaders over this engine's data-parallel rank."""

    _config: Any
    dp_world_size: int
    dp_rank: int
    mpu: Any
    training_dataloader: Any
    features: tuple[EngineFeature, ...]
    _extensions: Extensions

    if TYPE_CHECKING:
        @property
        def sequence_parallel_size(self) -> int: ...

    def deepspeed_io(self, dataset, batch_size: int | None = None, route=None,
                     pin_memory: bool = True, data_sampler=None, collate_fn=None,
                     num_local_io_workers: int | None = None):
        """DeepSpeed's loader for ``dataset``: this data-parallel rank's share of it
        (a ``DistributedSampler`` unless ``data_sampler`` is given), in micro-batches of
        ``train_micro_batch_size_per_gpu`` unless ``batch_size`` says otherwise. As in
        DeepSpeed, a training loader (``route`` unset or ``"train"``, no sampler given) is
        the curriculum's when ``data_efficiency`` enables curriculum learning."""
        from torch.utils.data import DataLoader, DistributedSampler

        if data_sampler is None and route in (None, "train"):
            loader = self._feature_loader(dataset, collate_fn)
            if loader is not None:
                return loader

        replicas, index = self.dp_world_size, self.dp_rank
        if self.sequence_parallel_size > 1:  # a sequence-parallel group shares its batches
            replicas = self.mpu.get_data_parallel_world_size()
            index = self.mpu.get_data_parallel_rank()
        sampler = data_sampler if data_sampler is not None else DistributedSampler(
            dataset, num_replicas=replicas, rank=index)
        return DataLoader(dataset, batch_size=batch_size or
                          self._config.train_micro_batch_size_per_gpu, sampler=sampler,
                          collate_fn=collate_fn, num_workers=num_local_io_workers or 0,
                          pin_memory=pin_memory and torch.cuda.is_available())

    def set_data_post_process_func(self, post_process_func) -> None:
        """DeepSpeed's: ``post_process_func(batch, sampler_state)`` is applied to each batch
        of the curriculum loader in place of the default (the seqlen metrics); without a
        curriculum loader, nothing (as DeepSpeed)."""
        self._extensions.export("set_data_post_process_func")(self, post_process_func)

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict) -> None:
        """DeepSpeed's: the functions (``step -> difficulty``, by metric name) of the
        curriculum's ``custom`` schedules."""
        self._extensions.export("set_custom_curriculum_learning_schedule")(
            self, schedule_func_dict)

    def random_ltd_initialize(self) -> None:
        """DeepSpeed's: bind the model's converted layers to the random-LTD schedule
        (``convert_to_random_ltd`` calls it; ``initialize`` already did for the layers of
        ``random_ltd_layer_id``)."""
        self._extensions.export("random_ltd_initialize")(self)

    def training_loader(self, dataset, collate_fn=None):
        """The loader ``initialize(training_data=dataset)`` returns (and keeps as
        ``training_dataloader``): a feature's (a curriculum sampler's), or one whose
        position is in checkpoints."""
        from deepshard.runtime.data_position import resumable_loader

        loader = self._feature_loader(dataset, collate_fn)
        self.training_dataloader = loader if loader is not None else resumable_loader(
            self, dataset, collate_fn)
        return self.training_dataloader

    def _feature_loader(self, dataset, collate_fn):
        """The first feature's training loader for ``dataset`` (a curriculum's), or None."""
        for feature in self.features:
            loader = feature.training_loader(self, dataset, collate_fn)
            if loader is not None:
                return loader
        return None

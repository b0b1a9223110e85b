"""``TrainingArguments`` and ``Trainer``: transformers' own, driving deepshard's engine.

transformers and Accelerate take their DeepSpeed path only when a distribution named
``deepspeed`` is installed, so a script that wants deepshard changes one import::

    from deepshard.integrations.transformers import Trainer, TrainingArguments

``TrainingArguments(deepspeed=path_or_dict)`` fills the config's ``"auto"`` values as
transformers does (:mod:`.hf_auto`) and keeps it alive as ``args.hf_deepspeed_config``
(models built after it load partitioned at ZeRO stage 3). ``Trainer`` builds the engine
with :func:`deepshard.initialize` where transformers calls ``deepspeed_init``, with the same
choice between the config's optimizer/scheduler and the Trainer's own, and then runs
transformers' training loop unchanged: Accelerate stays in its plain multi-process mode (it
shards the data loaders) and its four engine-facing calls (``backward``,
``clip_grad_norm_``, ``no_sync``, ``unwrap_model``) are pointed at the engine, as
Accelerate's DeepSpeed wrapper does. Checkpoints are the engine's (``checkpoint-N/global_stepN``)
next to the Trainer's state; ``resume_from_checkpoint`` also resumes a universal one in it, or
names the tag directory itself (:mod:`.hf_resume`); ``save_model`` writes the HF format
(:func:`deepshard.integrations.hf_save.save_pretrained`, from any stage).

Ulysses sequence parallelism (ALST), asked for by the config's ``sequence_parallel_size``
or, as HF documents it for DeepSpeed, by ``TrainingArguments(parallelism_config=
ParallelismConfig(sp_backend="deepspeed", sp_size=P))``: what Accelerate and the Trainer do
for DeepSpeed, over :mod:`deepshard.sequence`. The model's attention is wrapped
(``UlyssesSPAttentionHF.register_with_transformers``, its groups are the engine's ``mpu``),
the training loader goes through ``UlyssesSPDataLoaderAdapter`` (each batch's tokens split
over a group, global ``position_ids``, ``shift_labels``), and the loss is the token sum of
the shard divided by the valid tokens of the whole optimizer step (all ranks, all
accumulated micro-batches, as the Trainer divides without sequence parallelism), so
SP x DP trains as plain data parallelism over the same batches. Accelerate never sees
``parallelism_config`` (on CPU it refuses one; its DeepSpeed path needs the package).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import warnings
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch
import transformers
from accelerate import Accelerator
from accelerate.utils.deepspeed import DeepSpeedOptimizerWrapper, DeepSpeedSchedulerWrapper

from deepshard.errors import UsageError
from deepshard.integrations import hf_resume
from deepshard.integrations.hf_auto import HfTrainerDeepShardConfig, check_parallelism_config

logger = logging.getLogger("deepshard")

SCHEDULER_NAME = "scheduler.pt"  # transformers' trainer_utils names
TRAINING_ARGS_NAME = "training_args.bin"


class TrainingArguments(transformers.TrainingArguments):
    """transformers' ``TrainingArguments``; ``deepspeed=`` (a config path or dict) selects
    deepshard instead of DeepSpeed.

    After construction ``hf_deepspeed_config`` holds the
    :class:`~deepshard.integrations.hf_auto.HfTrainerDeepShardConfig` with the values known
    from these arguments filled in (``None`` without ``deepspeed``); ``deepspeed`` keeps the
    value given. Accelerate is set up in its plain distributed mode.
    """

    if TYPE_CHECKING:  # transformers' field (its classes are Any to mypy)
        deepspeed: Any

    def __post_init__(self):
        source = self.deepspeed
        self.deepspeed = None  # transformers' branch would need the deepspeed package
        try:
            super().__post_init__()
        finally:
            self.deepspeed = source
        self.hf_deepspeed_config = None
        if source:
            self.hf_deepspeed_config = HfTrainerDeepShardConfig(source)
            self.hf_deepspeed_config.trainer_config_process(self)

    @cached_property
    def _setup_devices(self) -> torch.device:
        saved, self.deepspeed = self.deepspeed, None  # Accelerate's plain distributed mode
        try:
            return transformers.TrainingArguments._setup_devices.func(self)
        finally:
            self.deepspeed = saved

    @property
    def place_model_on_device(self) -> bool | None:
        """The engine places the model (as with DeepSpeed: never before it exists)."""
        return False if self.deepspeed else None


class _EngineAccelerator(Accelerator):
    """The Trainer's ``Accelerator`` with its engine-facing calls pointed at the engine, as
    Accelerate's ``DeepSpeedEngineWrapper`` does. Set on the Trainer's accelerator by
    class (it adds no state besides ``engine``): the Trainer builds its accelerator itself.
    """

    engine = None

    def backward(self, loss, **kwargs):
        """``engine.backward`` (loss already scaled for accumulation by the Trainer), and at
        an accumulation boundary ``engine.step``: reduction, clipping, optimizer step."""
        if self.engine is None:
            return super().backward(loss, **kwargs)
        sync = self.sync_gradients
        self.engine.set_gradient_accumulation_boundary(sync)
        self.engine.backward(loss, scale_wrt_gas=False)
        if sync:
            self.engine.step()
        return None

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """The engine clips in ``step``: the norm it found there."""
        if self.engine is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        return self.engine.get_global_grad_norm()

    def no_sync(self, model):
        """The engine accumulates between boundaries itself (DeepSpeed's path)."""
        if self.engine is not None and model is self.engine:
            return contextlib.nullcontext()
        return super().no_sync(model)

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        """The module inside the engine; anything else as Accelerate unwraps it."""
        if self.engine is not None and model is self.engine:
            return self.engine.module
        return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """fp16 overflow: the engine skipped the step, so the Trainer's scheduler waits."""
        if self.engine is None:
            return super().optimizer_step_was_skipped
        return not self.engine.was_step_applied()


class Trainer(transformers.Trainer):
    """transformers' ``Trainer``; with :class:`TrainingArguments` carrying ``deepspeed=``
    it trains through a deepshard engine at ZeRO stages 0-3 (see the module docstring).

    After ``train()`` starts, ``trainer.deepspeed`` and ``trainer.model_wrapped`` are the
    engine and ``trainer.model`` the HF model, as with DeepSpeed.
    """

    if TYPE_CHECKING:  # transformers' attributes and ours (its classes are Any to mypy)
        deepspeed: Any
        lr_scheduler: Any
        _created_lr_scheduler: bool
        _engine_steps: int | None
        _sp_groups: Any
        _resume_tag: str | None

    # -- setup ---------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        config = getattr(self.args, "hf_deepspeed_config", None)
        self.is_deepshard_enabled = isinstance(config, HfTrainerDeepShardConfig)
        self._sp_groups = None
        pc = getattr(self.args, "parallelism_config", None)
        if self.is_deepshard_enabled and pc is not None:
            check_parallelism_config(pc)
            self.args.parallelism_config = None  # sequence parallelism is the engine's
        try:
            super().create_accelerator_and_postprocess()
        finally:
            if pc is not None:
                self.args.parallelism_config = pc
        if self.is_deepshard_enabled:
            self.accelerator.__class__ = _EngineAccelerator

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None,
              ignore_keys_for_eval: list[str] | None = None):
        """transformers' ``train``; ``resume_from_checkpoint`` may also name the engine's tag
        directory inside a ``checkpoint-N`` (a universal one, say) (:mod:`.hf_resume`)."""
        self._resume_tag = None
        if self.is_deepshard_enabled and isinstance(resume_from_checkpoint, (str, os.PathLike)):
            resume_from_checkpoint, self._resume_tag = hf_resume.checkpoint_folder(
                os.fspath(resume_from_checkpoint))
        return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval)

    @property
    def deepshard_config(self) -> HfTrainerDeepShardConfig:
        """The config the engine is built from (``args.hf_deepspeed_config``)."""
        return self.args.hf_deepspeed_config

    def get_sp_size(self) -> int:
        """The config's ``sequence_parallel_size`` (transformers reads Accelerate's)."""
        if not self.is_deepshard_enabled:
            return super().get_sp_size()
        return self.deepshard_config.sequence_parallel_size

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """Where transformers calls ``deepspeed_init`` and ``accelerator.prepare``: build the
        engine (and resume it); the data loader is already Accelerate's, sharded."""
        if not self.is_deepshard_enabled:
            return super()._prepare_for_training(max_steps, train_dataloader,
                                                 resume_from_checkpoint)
        engine = self._engine_for_training(max_steps)
        if self._sp_groups is not None:
            train_dataloader = self._sequence_parallel_loader(train_dataloader)
        if resume_from_checkpoint is not None:
            self._load_engine_checkpoint(resume_from_checkpoint,
                                         getattr(self, "_resume_tag", None))
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return engine, train_dataloader

    def _engine_for_training(self, max_steps: int):
        """A fresh training engine (the one ``evaluate()`` built ahead at ZeRO-3, when
        it is for these steps and has not stepped), as ``deepspeed_init`` re-inits."""
        engine = self.deepspeed
        if (engine is not None and getattr(self, "_engine_steps", None) == max_steps
                and engine.global_steps == 0):
            return engine
        if self._created_lr_scheduler:
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        return self._build_engine(max_steps)

    def _build_engine(self, max_steps: int):
        """Finalize the config, choose the optimizer and scheduler as transformers'
        ``deepspeed_optim_sched`` does, and ``deepshard.initialize`` the engine."""
        import deepshard

        cfg = self.deepshard_config
        cfg.trainer_config_finalize(self.args, self.model, max_steps)
        cfg.fill_accelerate_defaults(self.model, self.args.world_size)
        if self.deepspeed is not None:  # evaluate() before train(), or a second train()
            self.deepspeed.destroy()
        self.optimizer = None
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizer, scheduler = self._optimizer_and_scheduler(max_steps)
        engine, opt, _, sched = deepshard.initialize(
            model=self.model, model_parameters=params if optimizer is None else None,
            optimizer=optimizer, lr_scheduler=scheduler, config=cfg.config,
            mpu=self._sequence_parallel_groups())
        self._attach(engine)
        self._engine_steps = max_steps
        self.optimizer = DeepSpeedOptimizerWrapper(opt)
        if sched is not None:  # the engine steps it
            self.lr_scheduler = DeepSpeedSchedulerWrapper(sched, self.optimizer)
        else:  # the Trainer's own, stepped by the training loop
            self.create_scheduler(num_training_steps=max_steps, optimizer=opt)
        return engine

    def _optimizer_and_scheduler(self, max_steps: int):
        """transformers' choice: the config's optimizer section, else the Trainer's
        (``create_optimizer`` from the TrainingArguments); the config's scheduler section
        (built by the engine), else with the config's optimizer a callable building the
        Trainer's scheduler over it, else ``None`` (the Trainer builds and steps its own)."""
        config = self.deepshard_config.config
        optimizer = None
        if "optimizer" not in config:
            # transformers also sets zero_allow_untested_optimizer, which deepshard does
            # not need (any torch optimizer runs on ZeRO shards): left out, no warning
            optimizer = self.create_optimizer()
        if "scheduler" in config or optimizer is not None:
            return optimizer, None

        def build_scheduler(engine_optimizer):
            trainer = copy.copy(self)
            trainer.lr_scheduler = None
            return trainer.create_scheduler(num_training_steps=max_steps,
                                            optimizer=engine_optimizer)

        return optimizer, build_scheduler

    def _attach(self, engine) -> None:
        self.model_wrapped = self.deepspeed = engine
        self.accelerator.engine = engine

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        """Evaluation goes through the engine (built for inference when ``evaluate()``
        comes before ``train()``)."""
        if not self.is_deepshard_enabled:
            return super()._wrap_model(model, training, dataloader)
        if self.deepspeed is None and self.deepshard_config.is_zero3() \
                and self.train_dataset is not None:
            # a ZeRO-3 module is partitioned by one engine only: the one train() will use
            self._build_engine(self._planned_max_steps())
        elif self.deepspeed is None:
            self._build_inference_engine()
        return self.deepspeed

    def _planned_max_steps(self) -> int:
        """The optimizer steps ``train()`` will run (transformers' own computation)."""
        return self.set_initial_training_values(self.args, self.get_train_dataloader())[-1]

    def _update_auto_batch_size(self, batch_size) -> None:
        """``auto_find_batch_size`` retries with a smaller batch: the config is filled
        again from the arguments for it (not checked against the micro-batch, as in
        transformers) and the next ``train()`` builds a new engine."""
        super()._update_auto_batch_size(batch_size)
        if not self.is_deepshard_enabled:
            return
        if self.deepshard_config.is_zero3():
            raise UsageError("auto_find_batch_size at ZeRO stage 3", where="TrainingArguments",
                             hint="use ZeRO stage 0-2 with auto_find_batch_size, or set "
                                  "per_device_train_batch_size (transformers does not "
                                  "support it with DeepSpeed ZeRO-3 either)")
        original = self.args.per_device_train_batch_size
        self.args.per_device_train_batch_size = self._train_batch_size // max(1, self.args.n_gpu)
        try:
            config = HfTrainerDeepShardConfig(self.args.deepspeed)
            config.trainer_config_process(self.args, auto_find_batch_size=True)
        finally:
            self.args.per_device_train_batch_size = original
        self.args.hf_deepspeed_config = config
        self._engine_steps = None  # rebuilt for the new batch size

    def _build_inference_engine(self) -> None:
        """transformers' ``deepspeed_init(inference=True)``: no optimizer, no scheduler."""
        import deepshard

        cfg = self.deepshard_config
        cfg.trainer_config_finalize(self.args, self.model, 0)
        cfg.fill_accelerate_defaults(self.model, self.args.world_size)
        config = {k: v for k, v in cfg.config.items() if k not in ("optimizer", "scheduler")}
        engine, *_ = deepshard.initialize(model=self.model, config=config,
                                          mpu=self._sequence_parallel_groups())
        self._attach(engine)
        self._engine_steps = None

    # -- sequence parallelism ------------------------------------------------------------
    def _sequence_parallel_groups(self):
        """With ``sequence_parallel_size`` > 1: the attention wrapped once (Accelerate's
        call, evaluation unwrapped), its groups the engine's ``mpu``; else ``None``."""
        size = self.deepshard_config.sequence_parallel_size
        if size == 1 or self._sp_groups is not None:
            return self._sp_groups
        from deepshard.sequence.hf import UlyssesSPAttentionHF

        model = self.accelerator.unwrap_model(self.model)
        pc = getattr(self.args, "parallelism_config", None)
        handler = getattr(pc, "sp_handler", None)
        implementation = (getattr(handler, "sp_attn_implementation", None)
                          or getattr(model.config, "_attn_implementation", None) or "sdpa")
        self._sp_groups = UlyssesSPAttentionHF.register_with_transformers(
            model, implementation, size, self.args.per_device_train_batch_size,
            disable_in_eval=True)
        return self._sp_groups

    def _sequence_parallel_loader(self, loader):
        from deepshard.sequence.loader import UlyssesSPDataLoaderAdapter

        groups = self._sp_groups
        return UlyssesSPDataLoaderAdapter(
            loader, sp_rank=groups.get_sequence_parallel_rank(),
            sp_group=groups.get_sequence_parallel_group(),
            sp_world_size=groups.get_sequence_parallel_world_size(), device=self.args.device)

    def _get_num_items_in_batch(self, batch_samples, device):
        """Under sequence parallelism: the valid ``shift_labels`` of the step's shards,
        summed over every rank (``average_tokens_across_devices``) or over the group."""
        if self._sp_groups is None:
            return super()._get_num_items_in_batch(batch_samples, device)
        count = sum((b["shift_labels"].ne(-100).sum() for b in batch_samples),
                    torch.zeros((), dtype=torch.int64)).to(device)
        group = None if self.args.average_tokens_across_devices \
            else self._sp_groups.get_sequence_parallel_group()
        torch.distributed.all_reduce(count, group=group)
        return count

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Under sequence parallelism in training: the model's loss over ``shift_labels``
        summed and divided by ``num_items_in_batch``, scaled by the ranks the engine
        averages gradients over per token count (the whole world, or the group)."""
        if self._sp_groups is None or not model.training or num_items_in_batch is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if not self.model_accepts_loss_kwargs:
            raise UsageError(f"{type(self.accelerator.unwrap_model(model)).__name__}'s "
                             "forward takes no loss kwargs (shift_labels, "
                             "num_items_in_batch)", where="sequence_parallel_size",
                             hint="use a transformers causal LM, or a hand loop with "
                                  "deepshard.sequence.loss.sequence_parallel_loss")
        labels = inputs["shift_labels"]
        kwargs = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
        outputs = model(**kwargs, labels=labels, shift_labels=labels,
                        num_items_in_batch=num_items_in_batch)
        scale = (self.args.world_size if self.args.average_tokens_across_devices
                 else self._sp_groups.get_sequence_parallel_world_size())
        loss = outputs["loss"] * scale
        return (loss, outputs) if return_outputs else loss

    # -- checkpoints ---------------------------------------------------------------------
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine's checkpoint (model, optimizer, engine-stepped scheduler) in
        ``output_dir/global_stepN``, and the Trainer's own scheduler as ``scheduler.pt``."""
        if not self.is_deepshard_enabled:
            return super()._save_optimizer_and_scheduler(output_dir)
        self.deepspeed.save_checkpoint(output_dir,
                                       exclude_frozen_parameters=_is_peft(self.model))
        if self.args.should_save and not isinstance(self.lr_scheduler,
                                                    DeepSpeedSchedulerWrapper):
            with warnings.catch_warnings(record=True):
                torch.save(self.lr_scheduler.state_dict(),
                           os.path.join(output_dir, SCHEDULER_NAME))
        return None

    def _load_engine_checkpoint(self, checkpoint: str, tag: str | None = None) -> None:
        """transformers' ``deepspeed_load_checkpoint``: the engine resumes model, optimizer
        and scheduler (at any world size: deepshard reshards), from ``tag`` when given."""
        path, _ = self.deepspeed.load_checkpoint(
            checkpoint, tag=tag, load_module_strict=not _is_peft(self.model),
            load_optimizer_states=True, load_lr_scheduler_states=True)
        if path is None:
            raise UsageError("no deepshard engine checkpoint in it",
                             where=f"resume_from_checkpoint={checkpoint}",
                             hint="pass a checkpoint-N directory written by this Trainer "
                                  "with deepspeed= (it holds global_stepN/ and latest, or "
                                  "a universal folder and latest_universal)")

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The engine loaded its states; the Trainer's own scheduler loads here."""
        if not self.is_deepshard_enabled:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or isinstance(self.lr_scheduler, DeepSpeedSchedulerWrapper):
            return None
        path = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(path):
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))
        return None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """The engine loads the weights with its checkpoint (in ``_prepare_for_training``)."""
        if not self.is_deepshard_enabled:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        return None

    def _load_best_model(self) -> None:
        if not self.is_deepshard_enabled:
            return super()._load_best_model()
        best = self.state.best_model_checkpoint
        logger.info("loading the best model from %s (score: %s)", best, self.state.best_metric)
        self._load_engine_checkpoint(best)
        return None

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """The HF format (``save_pretrained``'s files) from the engine, on every rank (the
        gathers are collective; rank 0 writes), then the tokenizer and the arguments."""
        if not self.is_deepshard_enabled or state_dict is not None:
            return super()._save(output_dir, state_dict)
        from deepshard.integrations import hf_save

        output_dir = output_dir if output_dir is not None else self.args.output_dir
        # before train() there is no engine: the model itself (partitioned at stage 3)
        source = self.deepspeed if self.deepspeed is not None else self.model
        hf_save.save_pretrained(source, output_dir, is_main_process=self.args.should_save,
                                exclude_frozen_parameters=_is_peft(self.model))
        if self.args.should_save:
            self._save_extras(output_dir)
        return None

    def _save_extras(self, output_dir: str) -> None:
        """What transformers' ``_save`` writes besides the model."""
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        elif getattr(self.data_collator, "tokenizer", None) is not None:
            self.data_collator.tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))


def _is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)

"""Dynamic batching: batches built to a token budget, the learning rate scaled to each.

DeepSpeed's ``data_efficiency.data_sampling.dynamic_batching`` and its
``variable_batch_size_and_lr`` module: every sample's length (given, or read from the data
analyzer's ``seqlen`` metric under ``metrics_path``, which the analyzer writes when missing)
is packed into micro-batches of at most ``max_tokens`` tokens
(:mod:`~deepshard.data_efficiency.dynamic_batching_plan`); each data-parallel rank gets a
loader over its share of them, and the learning rate of each step is scaled to the number of
sequences in that step's batch (:mod:`~deepshard.data_efficiency.dynamic_batching_lr`).

``train_batch_size`` counts micro-batches: a step trains ``train_batch_size`` micro-batches
(``train_micro_batch_size_per_gpu`` per loader item, ``gradient_accumulation_steps`` items per
rank), and the configured learning rate is the one for ``train_batch_size`` sequences.
"""

from __future__ import annotations

import logging
import os
import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler

from deepshard.data_efficiency.dynamic_batching_lr import (
    ConstantLR,
    VariableBatchSizeLR,
    lr_scheduler_for_variable_batch_size,
)
from deepshard.data_efficiency.dynamic_batching_plan import (
    LR_SCALING_METHODS,
    PICKING_ORDERS,
    BatchArithmetic,
    BatchPlan,
    batch_by_seqlens,
    log_plan_warnings,
    lr_scaling_method_name,
    plan_arithmetic,
    plan_batches,
    plan_summary,
    scale_lr,
)
from deepshard.data_efficiency.dynamic_batching_settings import (
    KEY,
    DynamicBatchingSettings,
    dynamic_batching_settings,
)
from deepshard.errors import UsageError

__all__ = [
    "KEY", "LR_SCALING_METHODS", "PICKING_ORDERS", "BatchArithmetic", "BatchPlan", "ConstantLR",
    "DynamicBatchingSettings", "VariableBatchSize", "VariableBatchSizeLR", "batch_by_seqlens",
    "build_variable_batch_size", "dataloader_for_variable_batch_size",
    "dynamic_batching_settings", "get_dataloader_and_lr_scheduler_for_variable_batch_size",
    "get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed", "load_dataset_seqlens",
    "lr_scaling_method_name", "lr_scheduler_for_variable_batch_size", "plan_arithmetic",
    "plan_batches", "plan_summary", "scale_lr",
]

logger = logging.getLogger(__name__)

SEQLEN_METRIC = os.path.join("seqlen", "seqlen_sample_to_metric")
"""Where under ``metrics_path`` the data analyzer writes each sample's length."""

OpenIndex = Callable[[str], Sequence[Any]]
"""Opens an index file pair by its path prefix (:func:`index_files.open_index`)."""
RunAnalyzer = Callable[..., None]
"""Writes the ``seqlen`` metric: called as ``(dataset=, metric_fn=, collate_fn=, save_path=)``."""


@dataclass(frozen=True)
class VariableBatchSize:
    """What dynamic batching builds for one data-parallel rank."""

    dataloader: DataLoader
    """This rank's loader: ``micro_batch_size`` micro-batches per item."""
    lr_scheduler: VariableBatchSizeLR
    """The scheduler scaling the learning rate to each batch."""
    deepspeed_io_kwargs: dict[str, Any]
    """The loader's arguments, for ``engine.deepspeed_io(**kwargs)``."""
    plan: BatchPlan
    """The batches of the epoch, the same on every rank."""


class _CollateMicroBatches:
    """A loader item's micro-batches as one list of samples (padded to their batch's longest
    when asked), then the user's collate function. A class, not a closure: loader workers
    started with ``spawn`` pickle it."""

    def __init__(self, dataset: Any, batch_max_seqlens: Sequence[int],
                 collate_fn: Callable[[list[Any]], Any] | None,
                 padding_fn: Callable[[Any, int], Any] | None) -> None:
        self.dataset = dataset
        self.batch_max_seqlens = batch_max_seqlens
        self.collate_fn = collate_fn
        self.padding_fn = padding_fn

    def __call__(self, items: list[tuple[int, list[int]]]) -> Any:
        samples = []
        for batch_id, ids in items:
            batch = [self.dataset[i] for i in ids]
            if self.padding_fn is not None:
                size = self.batch_max_seqlens[batch_id]
                batch = [self.padding_fn(sample, size) for sample in batch]
            samples.extend(batch)
        return self.collate_fn(samples) if self.collate_fn else samples


def dataloader_for_variable_batch_size(
        dataset: Any, microbatch_ids: Sequence[tuple[int, Sequence[int]]],
        batch_max_seqlens: Sequence[int], dataloader_rank: int = 0,
        dataloader_batch_size: int = 1, dataloader_num_replicas: int = 1,
        dataloader_collate_fn: Callable[[list[Any]], Any] | None = None,
        dataloader_num_workers: int = 2, dataloader_pin_memory: bool = False,
        required_microbatches_of_same_seqlen: bool = False,
        sample_padding_fn: Callable[[Any, int], Any] | None = None,
) -> tuple[DataLoader, dict[str, Any]]:
    """DeepSpeed's loader for rank ``dataloader_rank`` of ``dataloader_num_replicas``: the
    micro-batches ``j`` with ``j % num_replicas == rank``, ``dataloader_batch_size`` of them
    per item, as one list of samples given to ``dataloader_collate_fn``.

    With ``required_microbatches_of_same_seqlen`` every sample goes through
    ``sample_padding_fn(sample, n)``, ``n`` the longest length of its batch. Returns the loader
    and its arguments for ``engine.deepspeed_io``. Each batch's micro-batches must share out
    evenly in items over the ranks, so that no item mixes two batches.
    """
    if not 0 <= dataloader_rank < dataloader_num_replicas:
        raise UsageError(f"rank {dataloader_rank} is not among {dataloader_num_replicas} "
                         "replicas", where="dataloader_rank")
    if dataloader_batch_size < 1:
        raise UsageError(f"must be positive, not {dataloader_batch_size}",
                         where="dataloader_batch_size")
    share = dataloader_num_replicas * dataloader_batch_size
    uneven = sorted({n for n in Counter(b for b, _ in microbatch_ids).values() if n % share})
    if uneven:
        raise UsageError(
            f"batches of {uneven[0]} micro-batches do not share out over "
            f"{dataloader_num_replicas} ranks x {dataloader_batch_size} per item",
            where="dataloader_batch_size",
            hint="train_batch_size must be a multiple of the data-parallel size times "
                 "train_micro_batch_size_per_gpu")
    if required_microbatches_of_same_seqlen and sample_padding_fn is None:
        raise UsageError("padding to each batch's longest sample needs a padding function",
                         where="sample_padding_fn",
                         hint="pass sample_padding_fn(sample, length) returning the padded sample")
    sampler = DistributedSampler(microbatch_ids, num_replicas=dataloader_num_replicas,
                                 rank=dataloader_rank, shuffle=False, drop_last=False)
    collate = _CollateMicroBatches(
        dataset, batch_max_seqlens, dataloader_collate_fn,
        sample_padding_fn if required_microbatches_of_same_seqlen else None)
    loader = DataLoader(microbatch_ids, batch_size=dataloader_batch_size, sampler=sampler,
                        num_workers=dataloader_num_workers, collate_fn=collate,
                        pin_memory=dataloader_pin_memory)
    kwargs = {"dataset": microbatch_ids, "batch_size": dataloader_batch_size,
              "pin_memory": dataloader_pin_memory, "data_sampler": sampler,
              "collate_fn": collate, "num_local_io_workers": dataloader_num_workers}
    return loader, kwargs


def get_dataloader_and_lr_scheduler_for_variable_batch_size(
        dataset: Any, dataset_seqlens: Sequence[Any], max_tokens: int,
        effective_batch_size: int, dataset_filter_ids: Sequence[int] | None = None,
        lr_scaling_method: str | None = "linear", min_batch_size: int | None = 1,
        max_batch_size: int | None = None, sequence_picking_order: str = "dataloader",
        dataloader_batch_size: int = 1, dataloader_rank: int = 0,
        dataloader_num_replicas: int = 1, dataloader_num_workers: int = 0,
        dataloader_collate_fn: Callable[[list[Any]], Any] | None = None,
        dataloader_pin_memory: bool = False, lr_scheduler_or_optimizer: Any = None,
        required_microbatches_of_same_size: bool = False,
        required_microbatches_of_same_seqlen: bool = False,
        sample_padding_fn: Callable[[Any, int], Any] | None = None, verbose: bool = False,
        seed: int | None = None,
) -> tuple[DataLoader, VariableBatchSizeLR, dict[str, Any]]:
    """DeepSpeed's function of this name: plan (:func:`plan_batches`), this rank's loader
    (:func:`dataloader_for_variable_batch_size`) and the learning-rate scheduler, with the
    learning rate meant for ``effective_batch_size`` sequences. A random picking order over
    several ranks needs a ``seed``: each rank plans alone."""
    built = _build(
        dataset=dataset, dataset_seqlens=dataset_seqlens, max_tokens=max_tokens,
        effective_batch_size=effective_batch_size, dataset_filter_ids=dataset_filter_ids,
        lr_scaling_method=lr_scaling_method, min_batch_size=min_batch_size,
        max_batch_size=max_batch_size, sequence_picking_order=sequence_picking_order,
        dataloader_batch_size=dataloader_batch_size, dataloader_rank=dataloader_rank,
        dataloader_num_replicas=dataloader_num_replicas,
        dataloader_num_workers=dataloader_num_workers,
        dataloader_collate_fn=dataloader_collate_fn,
        dataloader_pin_memory=dataloader_pin_memory,
        lr_scheduler_or_optimizer=lr_scheduler_or_optimizer,
        required_microbatches_of_same_size=required_microbatches_of_same_size,
        required_microbatches_of_same_seqlen=required_microbatches_of_same_seqlen,
        sample_padding_fn=sample_padding_fn, verbose=verbose, seed=seed)
    return built.dataloader, built.lr_scheduler, built.deepspeed_io_kwargs


def _build(*, dataset: Any, dataset_seqlens: Sequence[Any], max_tokens: int,
           effective_batch_size: int, dataset_filter_ids: Sequence[int] | None,
           lr_scaling_method: str | None, min_batch_size: int | None,
           max_batch_size: int | None, sequence_picking_order: str, dataloader_batch_size: int,
           dataloader_rank: int, dataloader_num_replicas: int, dataloader_num_workers: int,
           dataloader_collate_fn: Callable[[list[Any]], Any] | None,
           dataloader_pin_memory: bool, lr_scheduler_or_optimizer: Any,
           required_microbatches_of_same_size: bool,
           required_microbatches_of_same_seqlen: bool,
           sample_padding_fn: Callable[[Any, int], Any] | None, verbose: bool,
           seed: int | None) -> VariableBatchSize:
    if sequence_picking_order == "random" and seed is None and dataloader_num_replicas > 1:
        raise UsageError("a random picking order without a seed differs from rank to rank",
                         where="seed", hint="pass the same seed on every rank")
    plan = plan_batches(dataset_seqlens, max_tokens, sequence_ids=dataset_filter_ids,
                        min_batch_size=min_batch_size, max_batch_size=max_batch_size,
                        sequence_picking_order=sequence_picking_order,
                        effective_batch_size=effective_batch_size,
                        required_microbatches_of_same_size=required_microbatches_of_same_size,
                        seed=seed)
    if dataloader_rank == 0:
        log_plan_warnings(plan, logger)
        logger.info("%s", plan_summary(plan, lr_scaling_method=lr_scaling_method))
        if verbose:
            for row in plan_arithmetic(plan, dp_world_size=dataloader_num_replicas,
                                       lr_scaling_method=lr_scaling_method):
                logger.info("dynamic batching: %s", row)
    loader, kwargs = dataloader_for_variable_batch_size(
        dataset, plan.microbatch_ids(), plan.batch_max_seqlens, dataloader_rank=dataloader_rank,
        dataloader_batch_size=dataloader_batch_size,
        dataloader_num_replicas=dataloader_num_replicas,
        dataloader_collate_fn=dataloader_collate_fn,
        dataloader_num_workers=dataloader_num_workers, dataloader_pin_memory=dataloader_pin_memory,
        required_microbatches_of_same_seqlen=required_microbatches_of_same_seqlen,
        sample_padding_fn=sample_padding_fn)
    scheduler = lr_scheduler_for_variable_batch_size(
        effective_batch_size, plan.batch_sizes, loader, lr_scheduler_or_optimizer,
        lr_scaling_method=lr_scaling_method, verbose=verbose)
    return VariableBatchSize(loader, scheduler, kwargs, plan)


def build_variable_batch_size(
        dataset: Any, data_efficiency_config: Mapping[str, Any], *, train_batch_size: int,
        micro_batch_size: int, dp_rank: int, dp_world_size: int, lr_scheduler_or_optimizer: Any,
        pipeline: bool = False, dataset_seqlens: Sequence[Any] | None = None,
        dataset_filter_ids: Sequence[int] | None = None,
        dataloader_collate_fn: Callable[[list[Any]], Any] | None = None,
        sample_padding_fn: Callable[[Any, int], Any] | None = None,
        batch_seqlens_fn: Callable[[Any], Any] | None = None,
        open_index: OpenIndex | None = None, run_analyzer: RunAnalyzer | None = None,
) -> VariableBatchSize:
    """Dynamic batching for one data-parallel rank, set by ``data_efficiency_config`` (the
    ``data_efficiency`` section, as written or as DeepSpeed normalises it).

    The lengths are ``dataset_seqlens``, else :func:`load_dataset_seqlens` from the settings'
    ``metrics_path``. ``pipeline`` asks for micro-batches of one size and samples padded to
    their batch's longest (what pipeline parallelism needs).
    """
    settings = dynamic_batching_settings(data_efficiency_config)
    if dataset_seqlens is None:
        if settings.metrics_path is None:
            raise UsageError("no sample lengths: neither dataset_seqlens nor a metrics_path",
                             where=f"{KEY}.metrics_path",
                             hint="set metrics_path (where the data analyzer writes them) or "
                                  "pass dataset_seqlens")
        dataset_seqlens = load_dataset_seqlens(
            dataset, settings.metrics_path, batch_seqlens_fn=batch_seqlens_fn,
            collate_fn=dataloader_collate_fn, open_index=open_index, run_analyzer=run_analyzer)
    elif hasattr(dataset, "__len__") and len(dataset_seqlens) != len(dataset):
        raise UsageError(f"{len(dataset_seqlens)} lengths for {len(dataset)} samples",
                         where="dataset_seqlens")
    try:
        return _build(
            dataset=dataset, dataset_seqlens=dataset_seqlens, max_tokens=settings.max_tokens,
            effective_batch_size=train_batch_size, dataset_filter_ids=dataset_filter_ids,
            lr_scaling_method=settings.lr_scaling_method,
            min_batch_size=settings.min_batch_size, max_batch_size=settings.max_batch_size,
            sequence_picking_order=settings.sequence_picking_order,
            dataloader_batch_size=micro_batch_size, dataloader_rank=dp_rank,
            dataloader_num_replicas=dp_world_size, dataloader_num_workers=settings.num_workers,
            dataloader_collate_fn=dataloader_collate_fn, dataloader_pin_memory=settings.pin_memory,
            lr_scheduler_or_optimizer=lr_scheduler_or_optimizer,
            required_microbatches_of_same_size=pipeline,
            required_microbatches_of_same_seqlen=pipeline, sample_padding_fn=sample_padding_fn,
            verbose=settings.verbose, seed=settings.seed)
    except UsageError as error:
        if error.where != "max_tokens":  # the one plan error a setting causes
            raise
        raise UsageError(error.message, where=f"{KEY}.max_tokens", hint=error.hint) from None


def get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        dataset: Any, engine: Any, dataset_seqlens: Sequence[Any] | None = None,
        dataset_filter_ids: Sequence[int] | None = None,
        dataloader_collate_fn: Callable[[list[Any]], Any] | None = None,
        sample_padding_fn: Callable[[Any, int], Any] | None = None,
        batch_seqlens_fn: Callable[[Any], Any] | None = None, *,
        replace_lr_scheduler: bool = True,
) -> tuple[DataLoader, VariableBatchSizeLR, dict[str, Any]]:
    """DeepSpeed's entry point: :func:`build_variable_batch_size` for ``engine`` (its
    ``data_efficiency`` config, batch sizes, data-parallel rank, scheduler or optimizer).

    Returns ``(dataloader, lr_scheduler, deepspeed_io_kwargs)``. With
    ``replace_lr_scheduler`` (the default; DeepSpeed 0.19.8 does not) the scheduler becomes
    ``engine.lr_scheduler``, so that ``engine.step()`` steps it and checkpoints save it:
    DeepSpeed's engine keeps stepping the scheduler it wraps, which undoes the scaling. A
    second call (a new subset of samples) wraps the scheduler the first one wrapped.
    """
    scheduler = engine.lr_scheduler
    if isinstance(scheduler, VariableBatchSizeLR):  # built before (a new curriculum step)
        scheduler = scheduler.base_lr_scheduler
    setup = build_variable_batch_size(
        dataset, engine.data_efficiency_config(), train_batch_size=engine.train_batch_size(),
        micro_batch_size=engine.train_micro_batch_size_per_gpu(), dp_rank=engine.dp_rank,
        dp_world_size=engine.dp_world_size,
        lr_scheduler_or_optimizer=scheduler or engine.optimizer,
        pipeline=_is_pipeline(engine), dataset_seqlens=dataset_seqlens,
        dataset_filter_ids=dataset_filter_ids, dataloader_collate_fn=dataloader_collate_fn,
        sample_padding_fn=sample_padding_fn, batch_seqlens_fn=batch_seqlens_fn,
        run_analyzer=_engine_analyzer())
    if replace_lr_scheduler:
        engine.lr_scheduler = setup.lr_scheduler
    return setup.dataloader, setup.lr_scheduler, setup.deepspeed_io_kwargs


def load_dataset_seqlens(dataset: Any, metrics_path: str | os.PathLike[str], *,
                         batch_seqlens_fn: Callable[[Any], Any] | None = None,
                         collate_fn: Callable[[list[Any]], Any] | None = None,
                         open_index: OpenIndex | None = None,
                         run_analyzer: RunAnalyzer | None = None) -> list[int]:
    """Each sample's length from the data analyzer's ``seqlen`` metric under
    ``metrics_path``; when its files are missing, ``run_analyzer`` writes them first with
    ``batch_seqlens_fn`` (a collated batch -> its samples' lengths) as the metric."""
    prefix = os.path.join(os.fspath(metrics_path), SEQLEN_METRIC)
    if not all(os.path.isfile(prefix + ext) for ext in (".idx", ".bin")):
        if batch_seqlens_fn is None:
            raise UsageError(f"no sample lengths at {prefix}.idx/.bin",
                             where=f"{KEY}.metrics_path",
                             hint="pass dataset_seqlens, or batch_seqlens_fn for the data "
                                  "analyzer to compute them")
        if run_analyzer is None:
            raise UsageError("the data analyzer is needed to compute the sample lengths",
                             where=f"{KEY}.metrics_path",
                             hint="pass dataset_seqlens or run the data analyzer first")
        logger.warning("dynamic batching: no sample lengths at %s; running the data analyzer",
                       prefix)
        run_analyzer(dataset=dataset, metric_fn=batch_seqlens_fn, collate_fn=collate_fn,
                     save_path=os.fspath(metrics_path))
    rows = (open_index or _open_index)(prefix)
    if hasattr(dataset, "__len__") and len(rows) != len(dataset):
        raise UsageError(f"{prefix} holds {len(rows)} lengths for {len(dataset)} samples",
                         where=f"{KEY}.metrics_path",
                         hint="the dataset changed: delete the metrics_path folder")
    lengths = []
    for i, row in enumerate(rows):
        values = [int(v) for v in (row if hasattr(row, "__len__") else [row])]
        if len(values) != 1:
            raise UsageError(f"{prefix} row {i} holds {len(values)} values, not one length",
                             where=f"{KEY}.metrics_path")
        lengths.append(values[0])
    return lengths


def _open_index(prefix: str) -> Sequence[Any]:
    from deepshard.data_efficiency.index_files import open_index

    return open_index(prefix)


def _is_pipeline(engine: Any) -> bool:
    # an engine cannot be a pipeline engine unless its module was imported: no import here
    module = sys.modules.get("deepshard.runtime.parallel.pipe_engine")
    return module is not None and isinstance(engine, module.PipelineEngine)


def _engine_analyzer() -> RunAnalyzer:
    """The data analyzer over the job's ranks, writing the ``seqlen`` metric."""
    def run(*, dataset: Any, metric_fn: Callable[[Any], Any],
            collate_fn: Callable[[list[Any]], Any] | None, save_path: str) -> None:
        from deepshard.data_efficiency.analyzer import SINGLE, DataAnalyzer

        # DeepSpeed's call: every rank maps a split, in batches of 1024 samples
        DataAnalyzer(dataset, batch_size=2**10, metric_names=["seqlen"],
                     metric_functions=[metric_fn], metric_types=[SINGLE], save_path=save_path,
                     collate_fn=collate_fn).run_map_reduce()
    return run

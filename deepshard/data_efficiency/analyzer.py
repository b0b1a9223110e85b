"""The data analyzer: per-sample difficulty metrics, indexed for curriculum learning.

DeepSpeed's ``DataAnalyzer``: a *map* over the dataset (each worker a contiguous split, in
batches) computes every metric, and a *reduce* on worker 0 writes, per metric, under
``save_path/<metric>/`` the index files (:mod:`.index_files`) curriculum learning and dynamic
batching read, with DeepSpeed's names and contents:

``single_value_per_sample`` (one integer per sample)
    ``<metric>_sample_to_metric``: row ``i`` is ``[value of sample i]`` (samples in map
    order); ``<metric>_index_to_metric``: one row ``[v]`` per distinct value, ascending;
    ``<metric>_index_to_sample``: the row of the samples with each value, in map order;
    ``<metric>_index_to_sample_percentile_merged``: the same samples with every
    ``max(1, distinct // 100)`` consecutive rows merged into one.
``accumulate_value_over_samples`` (an array summed over all batches)
    ``<metric>_metric_value``: one row, the sum.

Values are stored in the smallest integer dtype that holds them, sample ids in the smallest
that holds ``len(dataset) - 1``.

Resuming. A worker's map state lives in ``save_path/_map/worker<w>/``: ``chunk<k>.npz`` hold
the results of consecutive batches (every ``progress_every`` batches one is written), and
``progress.json`` says how many batches the written chunks cover and whether the split is
done, with a fingerprint of the job (dataset size, worker split, batch size, metrics, sample
indices). Each file is written under a temporary name and moved into place, chunk first,
then progress, so a crash at any point leaves a consistent state. A rerun of ``run_map``
(or ``run_map_reduce``) with the same fingerprint skips the covered batches and continues
with the next one; a finished split is not mapped again. A different fingerprint, or
``resume=False``, starts the worker over. The dataset's contents are not fingerprinted: after
changing them, pass ``resume=False`` or delete ``save_path``.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Subset

from deepshard.data_efficiency.index_files import (
    atomic_file,
    fit_int_dtype,
    index_dtype,
    write_index,
    write_index_concatenated,
)
from deepshard.errors import UsageError
from deepshard.runtime.logs import logger

SINGLE = "single_value_per_sample"
ACCUMULATE = "accumulate_value_over_samples"
METRIC_TYPES = (SINGLE, ACCUMULATE)
MAP_DIR = "_map"
_FORMAT = 1


def split_range(start: int, end: int, parts: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut into ``parts`` contiguous ranges, as DeepSpeed splits a dataset
    among its map workers."""
    bounds = np.linspace(start, end, num=parts + 1, dtype=int)
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(parts)]


class DataAnalyzer:
    """Map metric functions over a dataset and index the results (see the module docstring).

    Args:
        dataset: a map-style dataset (``len`` and ``[i]``).
        num_workers, worker_id: this worker's place among the map workers. By default the
            ranks of ``comm_group``, else of the initialized process group, else ``1, 0``.
        num_threads, num_threads_reduce: accepted for DeepSpeed's signature; a worker maps
            its split in one process (DeepSpeed's files with 1 reduce thread result).
        batch_size: samples per metric-function call.
        metric_names: one name per metric: the subfolder of ``save_path`` it is written to.
        metric_functions: one per metric, called with a collated batch; returns a tensor or
            array: one value per sample (``single_value_per_sample``), or an array of a fixed
            shape (``accumulate_value_over_samples``).
        metric_types: one of :data:`METRIC_TYPES` per metric.
        metric_dtypes: the integer dtype (numpy or torch) each function returns; ``None``
            takes whatever integer dtype it returns.
        save_path: the output folder.
        collate_fn: builds a batch from samples (torch's default collation when ``None``).
        sample_indices: the dataset's sample ids in iteration order, when they differ from
            ``0..len-1`` (a batch that is a dict with an ``"index"`` entry gives its own).
        comm_group: the process group whose ranks are the workers.
        progress_every: batches between two saves of map progress.
        resume: continue a map a previous run left unfinished (see the module docstring).
    """

    def __init__(self, dataset: Any, *, num_workers: int | None = None,
                 worker_id: int | None = None, num_threads: int = 1, num_threads_reduce: int = 1,
                 batch_size: int = 1, metric_names: Sequence[str] = (),
                 metric_functions: Sequence[Callable[[Any], Any]] = (),
                 metric_types: Sequence[str] = (), metric_dtypes: Sequence[Any] | None = None,
                 save_path: str | Path = "./", collate_fn: Callable[[list[Any]], Any] | None = None,
                 sample_indices: Sequence[int] | None = None, comm_group: Any = None,
                 progress_every: int = 16, resume: bool = True):
        self.dataset = dataset
        self.num_threads, self.num_threads_reduce = num_threads, num_threads_reduce
        self.batch_size = batch_size
        self.metric_names, self.metric_functions = list(metric_names), list(metric_functions)
        self.metric_types = list(metric_types)
        self.metric_dtypes = _declared_dtypes(metric_dtypes, len(self.metric_names))
        self.save_path = Path(save_path)
        self.collate_fn = collate_fn
        self.sample_indices = sample_indices
        self.comm_group = comm_group
        self.progress_every = progress_every
        self.resume = resume
        _check_arguments(self)
        self.num_workers, self.worker_id = _place(num_workers, worker_id, comm_group)

    # --- map -------------------------------------------------------------------------------

    def run_map(self) -> None:
        """Map the metrics over this worker's split, continuing a previous unfinished run."""
        state = Path(self.save_path, MAP_DIR, f"worker{self.worker_id}")
        fingerprint = self._fingerprint(self.worker_id)
        progress = _load_progress(state) if self.resume else None
        if progress is None or progress["fingerprint"] != fingerprint:
            shutil.rmtree(state, ignore_errors=True)
            progress = {"format": _FORMAT, "fingerprint": fingerprint, "batches": 0,
                        "chunks": 0, "done": False, "dtypes": list(fingerprint["dtypes"])}
        elif progress["done"]:
            logger.info("data analyzer worker %d: map already done", self.worker_id)
            return
        for stale in state.glob("chunk*.npz"):  # written after the last saved progress
            if int(stale.stem[5:]) >= progress["chunks"]:
                stale.unlink()
        for partial in state.glob("*.tmp"):  # a killed writer's
            partial.unlink()
        self._map_split(state, progress)

    def _map_split(self, state: Path, progress: dict[str, Any]) -> None:
        start, end = split_range(0, len(self.dataset), self.num_workers)[self.worker_id]
        first = start + progress["batches"] * self.batch_size
        logger.info("data analyzer worker %d: samples %d to %d, from %d", self.worker_id,
                    start, end, first)
        loader = DataLoader(Subset(self.dataset, range(first, end)), batch_size=self.batch_size,
                            shuffle=False, drop_last=False, collate_fn=self.collate_fn,
                            num_workers=0)
        pending: list[dict[str, np.ndarray]] = []
        for batch in loader:
            batch_start = start + progress["batches"] * self.batch_size
            count = min(self.batch_size, end - batch_start)
            pending.append(self._map_batch(batch, batch_start, count, progress["dtypes"]))
            progress["batches"] += 1
            if len(pending) >= self.progress_every:
                _save_chunk(state, progress, pending)
                pending = []
        progress["done"] = True
        _save_chunk(state, progress, pending)
        logger.info("data analyzer worker %d: map done", self.worker_id)

    def _map_batch(self, batch: Any, batch_start: int, count: int,
                   dtypes: list[str | None]) -> dict[str, np.ndarray]:
        result = {}
        functions = zip(self.metric_names, self.metric_functions, strict=True)
        for m, (name, function) in enumerate(functions):
            values = _metric_values(function(batch), name, dtypes, m)
            if self.metric_types[m] == SINGLE:
                if values.ndim == 0 or values.shape[0] != count or values.size != count:
                    raise UsageError(
                        f"metric {name!r} returned shape {tuple(values.shape)} for a batch of "
                        f"{count} samples", where="metric_functions",
                        hint="a single_value_per_sample metric returns one value per sample")
                result[f"v{m}"] = values.reshape(-1)
                result[f"s{m}"] = self._sample_ids(batch, batch_start, count)
            else:
                result[f"a{m}"] = values
        return result

    def _sample_ids(self, batch: Any, batch_start: int, count: int) -> np.ndarray:
        if isinstance(batch, dict) and "index" in batch:  # Megatron's batches carry their ids
            ids = np.asarray(_to_numpy(batch["index"])).reshape(count, -1)[:, 0]
            return ids.astype(np.int64)
        if self.sample_indices is None:
            return np.arange(batch_start, batch_start + count, dtype=np.int64)
        order = self.sample_indices
        return np.asarray([order[p] for p in range(batch_start, batch_start + count)], np.int64)

    def _fingerprint(self, worker_id: int) -> dict[str, Any]:
        start, end = split_range(0, len(self.dataset), self.num_workers)[worker_id]
        indices = None
        if self.sample_indices is not None:
            raw = np.asarray(self.sample_indices, dtype=np.int64).tobytes()
            indices = hashlib.sha256(raw).hexdigest()
        return {"num_samples": len(self.dataset), "num_workers": self.num_workers,
                "worker_id": worker_id, "start": start, "end": end,
                "batch_size": self.batch_size, "names": self.metric_names,
                "types": self.metric_types, "dtypes": self.metric_dtypes,
                "sample_indices": indices}

    # --- reduce ----------------------------------------------------------------------------

    def run_reduce(self) -> None:
        """Merge every worker's map into the index files under ``save_path/<metric>/``."""
        chunks = self._finished_chunks()
        total = len(self.dataset)
        for m, (name, kind) in enumerate(zip(self.metric_names, self.metric_types, strict=True)):
            folder = self.save_path / name
            if kind == SINGLE:
                values = np.concatenate([c[f"v{m}"] for c in chunks])
                samples = np.concatenate([c[f"s{m}"] for c in chunks])
                _write_single(folder / name, values, samples, total)
            else:
                parts = [c[f"a{m}"] for c in chunks if f"a{m}" in c]
                _write_accumulated(folder / f"{name}_metric_value", parts, name)
        logger.info("data analyzer: reduced %d metrics into %s", len(self.metric_names),
                    self.save_path)

    def _finished_chunks(self) -> list[dict[str, np.ndarray]]:
        """Every worker's chunks in worker, then batch order; every worker must be done."""
        if len(self.dataset) == 0:
            raise UsageError("the dataset is empty", where="DataAnalyzer(dataset=...)")
        chunks = []
        for w in range(self.num_workers):
            state = Path(self.save_path, MAP_DIR, f"worker{w}")
            progress = _load_progress(state)
            if (progress is None or not progress["done"]
                    or progress["fingerprint"] != self._fingerprint(w)):
                raise UsageError(
                    f"worker {w} of {self.num_workers} has not finished the map of these "
                    "metrics", where=str(state),
                    hint=f"run run_map() with worker_id={w}, num_workers={self.num_workers} "
                         "(it continues where it stopped), then run_reduce()")
            chunks += _load_chunks(state, progress["chunks"], w)
        return chunks

    # --- both ------------------------------------------------------------------------------

    def run_map_reduce(self, comm_group: Any = None) -> None:
        """``run_map`` on every worker, then ``run_reduce`` on worker 0; returns on every
        rank once the files are written. A failure on any rank raises on all of them."""
        group = comm_group if comm_group is not None else self.comm_group
        if self.num_workers > 1 and not (dist.is_available() and dist.is_initialized()):
            raise UsageError(
                f"run_map_reduce with {self.num_workers} workers needs a process group",
                where="DataAnalyzer.run_map_reduce",
                hint="initialize one first (deepshard.init_distributed()), or call run_map() "
                     "on each worker and run_reduce() once all are done")
        _raise_if_any_failed(_attempt(self.run_map), group, "map")
        reduce = self.run_reduce if self.worker_id == 0 else None
        _raise_if_any_failed(_attempt(reduce), group, "reduce")


def _check_arguments(analyzer: DataAnalyzer) -> None:
    names, count = analyzer.metric_names, len(analyzer.metric_names)
    where = "DataAnalyzer"
    if not names:
        raise UsageError("no metric to compute", where=f"{where}(metric_names=...)",
                         hint="name at least one metric, with its function and type")
    for field in ("metric_functions", "metric_types"):
        if len(getattr(analyzer, field)) != count:
            raise UsageError(f"{len(getattr(analyzer, field))} {field} for {count} "
                             "metric_names", where=f"{where}({field}=...)",
                             hint="give one per metric name")
    for name in names:
        if not name or "/" in name or name in (MAP_DIR, ".", "..") or names.count(name) > 1:
            raise UsageError(f"metric name {name!r} cannot be a folder of its own",
                             where=f"{where}(metric_names=...)",
                             hint=f"use distinct names without '/', other than {MAP_DIR!r}")
    for kind in analyzer.metric_types:
        if kind not in METRIC_TYPES:
            raise UsageError(f"unknown metric type {kind!r}", where=f"{where}(metric_types=...)",
                             hint=f"use {SINGLE!r} or {ACCUMULATE!r}")
    for field in ("batch_size", "progress_every"):
        if not isinstance(getattr(analyzer, field), int) or getattr(analyzer, field) < 1:
            raise UsageError(f"{field} must be a positive integer",
                             where=f"{where}({field}={getattr(analyzer, field)!r})")


def _declared_dtypes(dtypes: Sequence[Any] | None, count: int) -> list[str | None]:
    if dtypes is None or len(dtypes) == 0:
        return [None] * count
    if len(dtypes) != count:
        raise UsageError(f"{len(dtypes)} metric_dtypes for {count} metric_names",
                         where="DataAnalyzer(metric_dtypes=...)", hint="give one per metric")
    return [None if d is None else index_dtype(d).name for d in dtypes]


def _place(num_workers: int | None, worker_id: int | None, group: Any) -> tuple[int, int]:
    """This worker's (count, id): explicit, else the group's, else the job's, else (1, 0)."""
    if num_workers is None and worker_id is None:
        if group is not None or (dist.is_available() and dist.is_initialized()):
            return dist.get_world_size(group), dist.get_rank(group)
        return 1, 0
    workers = 1 if num_workers is None else num_workers
    me = 0 if worker_id is None else worker_id
    if workers < 1 or not 0 <= me < workers:
        raise UsageError(f"worker_id {me} is not one of num_workers {workers}",
                         where="DataAnalyzer(num_workers=..., worker_id=...)",
                         hint="worker_id counts from 0 to num_workers - 1")
    return workers, me


def _to_numpy(values: Any) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        return np.asarray(values.detach().cpu().numpy())
    return np.asarray(values)


def _metric_values(raw: Any, name: str, dtypes: list[str | None], m: int) -> np.ndarray:
    """A metric function's result as an array of its metric's dtype (fixed by the first
    batch when none was declared)."""
    if not isinstance(raw, (torch.Tensor, np.ndarray)):
        raise UsageError(f"metric {name!r} returned a {type(raw).__name__}",
                         where="metric_functions", hint="return a tensor or a numpy array")
    values = _to_numpy(raw)
    got = index_dtype(values.dtype).name
    if dtypes[m] is None:
        dtypes[m] = got
    if got != dtypes[m]:
        raise UsageError(f"metric {name!r} returned {got} values, its dtype is {dtypes[m]}",
                         where="metric_functions",
                         hint="return the dtype given in metric_dtypes (or cast the result)")
    return values


def _save_chunk(state: Path, progress: dict[str, Any], pending: list[dict[str, np.ndarray]],
                ) -> None:
    """Write ``pending`` batches' results as the next chunk, then the progress saying so."""
    if pending:
        merged: dict[str, np.ndarray] = {}
        for key in pending[0]:
            parts = [batch[key] for batch in pending]
            if key.startswith("a"):
                merged[key] = _accumulate(parts, key)
            else:
                merged[key] = np.concatenate(parts)
        buffer = io.BytesIO()
        np.savez(buffer, **cast(dict[str, Any], merged))  # (numpy's stub: a bool keyword)
        with atomic_file(state / f"chunk{progress['chunks']:06d}.npz") as out:
            out.write(buffer.getvalue())
        progress["chunks"] += 1
    with atomic_file(state / "progress.json") as out:
        out.write(json.dumps(progress, indent=1).encode())


def _accumulate(parts: list[np.ndarray], what: str) -> np.ndarray:
    """The sum of ``parts`` in their dtype (wrapping as DeepSpeed's in-place tensor sum)."""
    total: np.ndarray = parts[0].copy()
    for part in parts[1:]:
        if part.shape != total.shape:
            raise UsageError(f"accumulated metric {what} changed shape from "
                             f"{tuple(total.shape)} to {tuple(part.shape)}",
                             where="metric_functions",
                             hint="an accumulate_value_over_samples metric returns one shape")
        total += part
    return total


def _load_chunks(state: Path, count: int, worker: int) -> list[dict[str, np.ndarray]]:
    chunks = []
    for k in range(count):
        path = state / f"chunk{k:06d}.npz"
        try:
            with np.load(path) as data:
                chunks.append({key: data[key] for key in data.files})
        except (OSError, ValueError) as error:
            raise UsageError(f"map state of worker {worker} is damaged ({error})",
                             where=str(path), hint=f"map worker {worker} again: "
                             "DataAnalyzer(..., resume=False).run_map()") from error
    return chunks


def _load_progress(state: Path) -> dict[str, Any] | None:
    try:
        progress = json.loads((state / "progress.json").read_text())
    except (OSError, ValueError):
        return None
    return progress if isinstance(progress, dict) and progress.get("format") == _FORMAT else None


def _write_single(prefix: Path, values: np.ndarray, samples: np.ndarray, total: int) -> None:
    """The four index files of a ``single_value_per_sample`` metric (module docstring)."""
    if len(values) != total:
        raise UsageError(f"the map produced {len(values)} values for {total} samples",
                         where=str(prefix.parent), hint="the dataset's length changed")
    value_dtype = fit_int_dtype(int(values.min()), int(values.max()))
    sample_dtype = fit_int_dtype(0, total - 1)
    order = np.argsort(values, kind="stable")
    distinct, counts = np.unique(values[order], return_counts=True)
    by_value = samples[order]
    n, u = len(values), len(distinct)
    # DeepSpeed merges per-thread chunks into these three, which ends their document index
    # twice: [0, rows, rows]
    write_index_concatenated(f"{prefix}_sample_to_metric", values, np.ones(n), value_dtype,
                             doc_idx=[0, n, n])
    write_index_concatenated(f"{prefix}_index_to_sample", by_value, counts, sample_dtype,
                             doc_idx=[0, u, u])
    write_index_concatenated(f"{prefix}_index_to_metric", distinct, np.ones(u), value_dtype,
                             doc_idx=[0, u, u])
    step = max(1, u // 100)
    merged = np.add.reduceat(counts, np.arange(0, u, step))
    write_index_concatenated(f"{prefix}_index_to_sample_percentile_merged", by_value, merged,
                             sample_dtype)
    logger.info("data analyzer: %s has values %s to %s (%d distinct), stored as %s",
                prefix.name, values.min(), values.max(), u, value_dtype.name)


def _write_accumulated(path: Path, parts: list[np.ndarray], name: str) -> None:
    if not parts:
        raise UsageError(f"metric {name!r} has no value: no batch was mapped",
                         where="DataAnalyzer(dataset=...)")
    total = _accumulate(parts, name)
    dtype = fit_int_dtype(int(total.min()), int(total.max()))
    write_index(path, [total], dtype)


def _attempt(step: Callable[[], None] | None) -> Exception | None:
    try:
        if step is not None:
            step()
    except Exception as error:  # handed to _raise_if_any_failed, re-raised there
        return error
    return None


def _raise_if_any_failed(error: Exception | None, group: Any, phase: str) -> None:
    """Raise on every rank when ``phase`` failed on any (instead of a hang in a barrier)."""
    if not (dist.is_available() and dist.is_initialized()):
        if error is not None:
            raise error
        return
    report = None if error is None else f"{type(error).__name__}: {error}"
    reports: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, report, group=group)
    if error is not None:
        raise error
    failed = {rank: text for rank, text in enumerate(reports) if text is not None}
    if failed:
        raise RuntimeError(f"the data analyzer's {phase} failed on rank(s) {sorted(failed)}: "
                           f"{next(iter(failed.values()))}")

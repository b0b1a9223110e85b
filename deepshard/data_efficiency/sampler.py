"""The curriculum sampler: batches of sample ids drawn by difficulty (DeepSpeed's
``DeepSpeedDataSampler``).

Each global batch (micro batch x data-parallel size x gradient accumulation) advances the
curriculum step by one and updates every metric's schedule. When a difficulty changes, a
new *cluster* of samples becomes eligible (value-based: metric value in (previous,
current]; percentile-based: the samples between the two percentiles of the index; a
``single_cluster`` metric filters nothing; several index metrics intersect, minus the
samples already clustered). A global batch draws its sample count per cluster in
proportion to the clusters' sizes, takes the samples from each cluster's shuffled order
(reshuffled when used up), and is shuffled; each rank yields its slice of every micro
batch. With the same seed the ids equal DeepSpeed 0.19.8's
(``tests/data/data_efficiency/curriculum_sampler_ds0198.json``): the generator calls are
the same, in the same order.

DeepSpeed draws on rank 0 and broadcasts each global batch. Here every rank draws the
same global batch itself: the draw is a pure function of the seed, the config, the dataset
length, the index and the restored state, all equal on every rank, so the result is the
one rank 0 would broadcast, with no collective in the data loader (none to hang on, none
to order against prefetching) and no device tensor per batch. What it asks: every rank
reads the index (as it reads the dataset), a ``custom`` schedule function gives the same
value on every rank, and each rank holds the clusters (the dataset's sample ids, 4 bytes
each below 2**31 samples).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from deepshard.data_efficiency.curriculum import (
    METRICS_PATH,
    CurriculumMetric,
    CurriculumScheduler,
    ScheduleFunction,
    metrics_from_config,
)
from deepshard.errors import UsageError

logger = logging.getLogger(__name__)


class IndexRows(Protocol):
    """An index file's rows (``open_index(path_prefix)``): ``len()`` and ``[i]`` -> 1-D
    numpy array."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int, /) -> Any: ...


IndexOpener = Callable[[str], IndexRows]
"""``path_prefix -> rows`` of a DeepSpeed index file (``.bin``/``.idx``)."""


def _row(rows: IndexRows, i: int) -> np.ndarray:
    return np.asarray(rows[i]).reshape(-1)


@dataclass(frozen=True)
class MetricIndex:
    """A data analyzer's index of one metric: rows of sample ids in ascending metric order,
    with each row's metric value (value-based) or size (percentile-based)."""

    rows: IndexRows
    """``index_to_sample``: row ``i`` holds the ids of the samples with the ``i``-th value."""
    values: np.ndarray | None
    """``index_to_metric``: row ``i``'s metric value (value-based metrics)."""
    sizes: np.ndarray | None
    """Row lengths (percentile-based metrics)."""

    @classmethod
    def load(cls, spec: CurriculumMetric, open_index: IndexOpener) -> MetricIndex:
        """Open ``spec``'s index files (its values or row sizes are read once, here)."""
        assert spec.index_to_sample_path is not None
        rows = open_index(spec.index_to_sample_path)
        if spec.difficulty_type == "percentile":
            sizes = np.array([len(_row(rows, i)) for i in range(len(rows))], dtype=np.int64)
            return cls(rows, None, sizes)
        assert spec.index_to_metric_path is not None
        metric_rows = open_index(spec.index_to_metric_path)
        if len(metric_rows) != len(rows):
            raise UsageError(f"the index has {len(rows)} rows of samples but "
                             f"{len(metric_rows)} metric values",
                             where=f"{METRICS_PATH}.{spec.name}.index_to_metric_path",
                             hint="point both paths at the same data analyzer output")
        values = np.array([_row(metric_rows, i)[0] for i in range(len(metric_rows))])
        return cls(rows, values, None)

    def by_value(self, low: float, high: float) -> np.ndarray:
        """Ids of the samples whose value is in ``(low, high]``, in index order."""
        assert self.values is not None
        picked = np.flatnonzero((self.values > low) & (self.values <= high))
        return _concat([_row(self.rows, int(i)) for i in picked])

    def by_percentile(self, low: float, high: float, top: float) -> np.ndarray:
        """Ids of the samples between percentiles ``low`` and ``high`` of the index order
        (``top``: the metric's max_difficulty, the last percentile: it takes the rest)."""
        assert self.sizes is not None
        total = int(self.sizes.sum())
        per = total // int(top)
        start, end = per * int(low), (total if high == top else per * int(high))
        parts, offset = [], 0
        for i, size in enumerate(self.sizes.tolist()):
            if offset >= end:
                break
            if offset + size > start:
                parts.append(_row(self.rows, i)[max(0, start - offset):min(size, end - offset)])
            offset += size
        return _concat(parts)


def _concat(parts: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


@dataclass(frozen=True)
class BatchLayout:
    """How the sampler's batches are shaped and shared among data-parallel ranks."""

    dataset_len: int
    """Samples in one epoch of the dataset."""
    micro_batch_size: int
    """Samples per rank per micro batch."""
    gradient_accumulation_steps: int = 1
    """Micro batches per optimizer step."""
    data_parallel_rank: int = 0
    """This rank's place in the data-parallel group."""
    data_parallel_size: int = 1
    """Ranks in the data-parallel group."""
    num_epochs: int = 1000
    """``data_sampling.num_epochs``: the sampler stops after this many epochs' samples."""
    seed: int = 1234
    """``data_efficiency.seed``."""

    def __post_init__(self) -> None:
        if self.dataset_len <= 0:
            raise UsageError("curriculum learning needs training data, and it has no sample",
                             where="training_data")
        assert self.micro_batch_size > 0 and self.gradient_accumulation_steps > 0
        assert 0 <= self.data_parallel_rank < self.data_parallel_size

    @property
    def chunk(self) -> int:
        """Samples of one micro batch over all ranks."""
        return self.micro_batch_size * self.data_parallel_size

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step (one curriculum step)."""
        return self.chunk * self.gradient_accumulation_steps

    @property
    def total_samples(self) -> int:
        """Samples the sampler yields over all ranks before it stops."""
        return self.dataset_len * self.num_epochs


class CurriculumSampler:
    """A batch sampler yielding this rank's micro batches of sample ids, by difficulty.

    Use it as a ``DataLoader``'s ``batch_sampler``. It continues where it is: iterating
    again does not restart it; :meth:`state_dict`/:meth:`load_state_dict` carry it across
    a resume (also to another data-parallel size, see :meth:`load_state_dict`).
    """

    def __init__(self, metrics: Sequence[CurriculumMetric], layout: BatchLayout,
                 indexes: Mapping[str, MetricIndex] | None = None, *,
                 cluster_dir: str | None = None, open_index: IndexOpener | None = None) -> None:
        self.metrics = tuple(metrics)
        self.layout = layout
        self.indexes = dict(indexes or {})
        self.cluster_dir = cluster_dir
        self.open_index = open_index
        self._schedulers = {m.name: CurriculumScheduler(m) for m in self.metrics}
        self._rng = np.random.default_rng(layout.seed)
        self._dtype = np.int32 if layout.dataset_len <= np.iinfo(np.int32).max else np.int64
        self._step = 0
        self._consumed = 0
        self._batch: list[int] = []
        self._difficulties: dict[str, float] = {}
        self._clusters: list[np.ndarray] = []
        self._positions: list[int] = []
        self._names: list[str] = []

    @classmethod
    def from_config(cls, data_efficiency: Mapping[str, Any], *, dataset_len: int,
                    micro_batch_size: int, gradient_accumulation_steps: int = 1,
                    data_parallel_rank: int = 0, data_parallel_size: int = 1,
                    open_index: IndexOpener | None = None) -> CurriculumSampler:
        """The sampler of a ``data_efficiency`` section (DeepSpeed's dict, or deepshard's
        schema dumped as one); ``open_index`` opens the index metrics' files."""
        sampling = data_efficiency.get("data_sampling") or {}
        curriculum = sampling.get("curriculum_learning") or {}
        metrics = metrics_from_config(curriculum)
        layout = BatchLayout(dataset_len=dataset_len, micro_batch_size=micro_batch_size,
                             gradient_accumulation_steps=gradient_accumulation_steps,
                             data_parallel_rank=data_parallel_rank,
                             data_parallel_size=data_parallel_size,
                             num_epochs=int(_given(sampling.get("num_epochs"), 1000)),
                             seed=int(_given(data_efficiency.get("seed"), 1234)))
        index_metrics = [m for m in metrics if not m.single_cluster]
        if index_metrics and open_index is None:
            raise ValueError("index metrics need open_index to read their files")
        indexes = {m.name: MetricIndex.load(m, open_index) for m in index_metrics
                   if open_index is not None}
        return cls(metrics, layout, indexes, cluster_dir=curriculum.get("data_cluster_path"),
                   open_index=open_index)

    # ---- the public surface DeepSpeed's sampler has ----

    @property
    def current_difficulties(self) -> dict[str, float]:
        """Each metric's difficulty for the batches being drawn (empty before the first)."""
        return dict(self._difficulties)

    @property
    def curriculum_step(self) -> int:
        """Global batches drawn so far."""
        return self._step

    def set_custom_curriculum_learning_schedule(
            self, schedule_func_dict: Mapping[str, ScheduleFunction]) -> None:
        """Give ``custom`` schedules their functions, by metric name (``step -> difficulty``;
        the same value on every rank). Names that are not metrics are ignored, as in
        DeepSpeed."""
        for name, function in schedule_func_dict.items():
            if name in self._schedulers:
                self._schedulers[name].set_custom_get_difficulty(function)
            else:
                logger.warning("set_custom_curriculum_learning_schedule: %r is not a "
                               "curriculum metric (metrics: %s)", name,
                               ", ".join(self._schedulers))

    def __len__(self) -> int:
        """Micro batches this rank yields from the start (DeepSpeed's returns samples)."""
        return math.ceil(self.layout.total_samples / self.layout.chunk)

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's micro batches of sample ids, from where the sampler is."""
        chunk, rank = self.layout.chunk, self.layout.data_parallel_rank
        mine = slice(rank * self.layout.micro_batch_size,
                     (rank + 1) * self.layout.micro_batch_size)
        while self._consumed < self.layout.total_samples:
            if not self._batch:
                self._next_global_batch()
            ids, self._batch = self._batch[:chunk], self._batch[chunk:]
            if len(ids) < chunk:  # only after a resume to another micro-batch shape
                continue
            self._consumed += chunk
            yield ids[mine]

    # ---- drawing ----

    def _next_global_batch(self) -> None:
        self._step += 1
        previous, changed = {}, False
        for spec in self.metrics:
            new = self._schedulers[spec.name].update_difficulty(self._step)
            old = self._difficulties.get(spec.name)
            changed = changed or old is None or new != old
            previous[spec.name] = _lowest(spec) if old is None else old
            self._difficulties[spec.name] = new
        if changed:
            self._add_cluster(previous)
        if not self._clusters:
            raise UsageError(f"no sample is eligible at curriculum step {self._step} "
                             f"(difficulties {self._difficulties})", where=METRICS_PATH,
                             hint="raise the index metrics' min_difficulty so that the "
                                  "first difficulties select some samples")
        sizes = [len(c) for c in self._clusters]
        total = sum(sizes)
        weights = [s / total for s in sizes]
        picks = self._rng.choice(len(sizes), self.layout.global_batch_size, replace=True,
                                 p=weights)
        counts = np.bincount(picks, minlength=len(sizes))
        batch = np.concatenate([self._take(i, int(n)) for i, n in enumerate(counts)])
        self._rng.shuffle(batch)
        self._batch = batch.tolist()

    def _add_cluster(self, previous: Mapping[str, float]) -> None:
        found = self._eligible(previous)
        if found is None or len(found) == 0:
            logger.debug("curriculum step %d: difficulties %s add no sample", self._step,
                         self._difficulties)
            return
        cluster = np.array(found, dtype=self._dtype)
        self._rng.shuffle(cluster)
        name = "cluster" + "".join(f"_{m}{d}" for m, d in self._difficulties.items())
        self._clusters.append(cluster)
        self._positions.append(0)
        self._names.append(name)
        if self.layout.data_parallel_rank == 0:
            logger.info("curriculum step %d: %d samples join (%s)", self._step, len(cluster),
                        name)
            if self.cluster_dir:
                _write_cluster(self.cluster_dir, name, cluster)

    def _eligible(self, previous: Mapping[str, float]) -> np.ndarray | None:
        """The samples a difficulty change adds (DeepSpeed's two cases: with several index
        metrics, all samples within every metric's current difficulty not yet clustered;
        otherwise all samples at first, or those the one index metric adds)."""
        index_metrics = [m for m in self.metrics if not m.single_cluster]
        if len(index_metrics) > 1:
            found: np.ndarray | None = None
            for spec in self.metrics:
                part = (np.arange(self.layout.dataset_len, dtype=self._dtype)
                        if spec.single_cluster
                        else self._select(spec, _lowest(spec), self._difficulties[spec.name]))
                found = part if found is None else np.intersect1d(found, part,
                                                                  assume_unique=True)
            assert found is not None
            for cluster in self._clusters:
                found = np.setdiff1d(found, cluster, assume_unique=True)
            return found
        found = None if self._clusters else np.arange(self.layout.dataset_len, dtype=self._dtype)
        for spec in index_metrics:
            found = self._select(spec, previous[spec.name], self._difficulties[spec.name])
        return found

    def _select(self, spec: CurriculumMetric, low: float, high: float) -> np.ndarray:
        index = self.indexes[spec.name]
        if spec.difficulty_type == "value":
            return index.by_value(low, high)
        return index.by_percentile(low, high, spec.max_difficulty)

    def _take(self, cidx: int, n: int) -> np.ndarray:
        """``n`` ids from cluster ``cidx``'s order, reshuffling it when used up."""
        order, position = self._clusters[cidx], self._positions[cidx]
        parts = [order[position:position + n]]
        got = len(parts[0])
        position += got
        while got < n:
            order = order.copy()  # never in place: earlier state_dicts share the arrays
            self._rng.shuffle(order)
            parts.append(order[:n - got])
            got += len(parts[-1])
            position = len(parts[-1])
        self._clusters[cidx], self._positions[cidx] = order, position
        return np.concatenate(parts)

    # ---- checkpoints ----

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: DeepSpeed's keys, plus the clusters'
        current orders (``data_clusters``, int tensors sharing the sampler's arrays) and the
        generator's state (``np_generator_state``); cheap enough to call per batch."""
        return {"batch": list(self._batch), "consumed_samples": self._consumed,
                "curriculum_step": self._step,
                "current_difficulties": dict(self._difficulties),
                "data_cluster_paths": list(self._names),
                "data_cluster_current_position": list(self._positions),
                "data_clusters": [torch.from_numpy(c) for c in self._clusters],
                "np_generator_state": self._rng.bit_generator.state,
                "dataset_len": self.layout.dataset_len}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` (or from DeepSpeed's sampler state).

        The sequence of global batches continues exactly as without the interruption,
        also on another data-parallel size, as long as the global batch size is the same
        (another size draws the following batches at that size). A batch remainder that
        is not a whole number of the new micro batches over all ranks is dropped.

        A DeepSpeed state names cluster files under ``data_cluster_path`` (read with
        ``open_index``) and holds no generator state: as DeepSpeed after a resume, the
        generator starts again from the seed.
        """
        state = dict(state_dict)
        difficulties = dict(state["current_difficulties"])
        names = {m.name for m in self.metrics}
        if difficulties and set(difficulties) != names:
            raise UsageError(f"the checkpoint's curriculum metrics {sorted(difficulties)} "
                             f"are not the config's {sorted(names)}", where=METRICS_PATH,
                             hint="resume with the curriculum_metrics the run was saved with")
        if state.get("dataset_len", self.layout.dataset_len) != self.layout.dataset_len:
            raise UsageError(f"the checkpoint's sampler drew from {state['dataset_len']} "
                             f"samples, the training data has {self.layout.dataset_len}",
                             where="training_data", hint="resume with the same dataset")
        if "data_clusters" in state:
            clusters = [np.array(_as_numpy(c), dtype=self._dtype) for c in state["data_clusters"]]
        else:
            clusters = self._deepspeed_clusters(state["data_cluster_paths"])
        self._rng = np.random.default_rng(self.layout.seed)
        if "np_generator_state" in state:
            self._rng.bit_generator.state = state["np_generator_state"]
        self._batch = [int(i) for i in state["batch"]]
        self._consumed = int(state["consumed_samples"])
        self._step = int(state["curriculum_step"])
        self._difficulties = difficulties
        self._clusters = clusters
        self._positions = [int(p) for p in state["data_cluster_current_position"]]
        self._names = [str(n).split("/")[-1] for n in state["data_cluster_paths"]]
        for name, value in difficulties.items():
            self._schedulers[name].current_difficulty = value

    def _deepspeed_clusters(self, paths: Sequence[str]) -> list[np.ndarray]:
        if not paths:
            return []
        if not self.cluster_dir or self.open_index is None:
            raise UsageError("this checkpoint's data_sampler is DeepSpeed's: its clusters "
                             "are files under data_cluster_path, which is not set",
                             where="data_efficiency.data_sampling.curriculum_learning."
                                   "data_cluster_path",
                             hint="set data_cluster_path to the directory the DeepSpeed "
                                  "run wrote its clusters to")
        return [np.array(_row(self.open_index(f"{self.cluster_dir}/{str(p).split('/')[-1]}"), 0),
                         dtype=self._dtype) for p in paths]


def _given(value: Any, default: int) -> Any:
    return default if value is None else value


def _lowest(spec: CurriculumMetric) -> float:
    """The difficulty before the first: nothing is eligible below it."""
    return float("-inf") if spec.difficulty_type == "value" else 0


def _as_numpy(values: Any) -> np.ndarray:
    return values.numpy() if isinstance(values, torch.Tensor) else np.asarray(values)


def _write_cluster(directory: str, name: str, cluster: np.ndarray) -> None:
    """``<directory>/<name>.npy``, for inspection (several writers of one file each
    replace it whole)."""
    os.makedirs(directory, exist_ok=True)
    temporary = os.path.join(directory, f".{name}.{os.getpid()}.npy")
    np.save(temporary, cluster)
    os.replace(temporary, os.path.join(directory, f"{name}.npy"))

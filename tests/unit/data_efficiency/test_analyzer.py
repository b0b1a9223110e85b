"""deepshard.data_efficiency.analyzer.DataAnalyzer: the metric index against a direct
computation, the same files from 1 worker, 2 workers and 2 real gloo ranks as DeepSpeed
0.19.8's DataAnalyzer wrote (``tests/data/data_efficiency/analyzer``, by
``make_index_fixtures.py`` there), and a map that resumes after a crash."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepshard.data_efficiency.analyzer import MAP_DIR, DataAnalyzer
from deepshard.data_efficiency.index_files import open_index
from deepshard.errors import UsageError
from tests.data.data_efficiency import synthetic as syn
from tests.helpers import ROOT

FIXTURE = ROOT / "tests" / "data" / "data_efficiency" / "analyzer"
FILES = sorted(p.relative_to(FIXTURE) for p in FIXTURE.rglob("*") if p.is_file())


def analyzer(save_path, functions=None, **kwargs) -> DataAnalyzer:
    """The fixture's job: the synthetic tokens, its 4 metrics, batches of 16."""
    options = dict(batch_size=syn.BATCH_SIZE, metric_names=syn.METRIC_NAMES,
                   metric_functions=functions or syn.METRIC_FUNCTIONS,
                   metric_types=syn.METRIC_TYPES, metric_dtypes=[torch.int64] * 4,
                   save_path=save_path, collate_fn=syn.collate)
    options.update(kwargs)
    return DataAnalyzer(syn.TokenDataset(), **options)


def assert_same_as_deepspeed(save_path) -> None:
    for rel in FILES:
        assert (Path(save_path) / rel).read_bytes() == (FIXTURE / rel).read_bytes(), rel


def rows(path) -> list[list[int]]:
    return [r.tolist() for r in open_index(path)]


@pytest.mark.parametrize("metric", ["seqlen", "tokensum"])
def test_the_index_matches_a_direct_computation(tmp_path, metric):
    function = {"seqlen": syn.seqlen, "tokensum": syn.tokensum}[metric]
    DataAnalyzer(syn.TokenDataset(), batch_size=7, metric_names=[metric],
                 metric_functions=[function], metric_types=["single_value_per_sample"],
                 save_path=tmp_path, collate_fn=syn.collate).run_map_reduce()
    values = np.array([int(function([torch.from_numpy(r)])[0]) for r in syn.token_rows()])
    base = tmp_path / metric / metric
    assert rows(f"{base}_sample_to_metric") == [[v] for v in values]
    distinct = np.unique(values)
    assert rows(f"{base}_index_to_metric") == [[v] for v in distinct]
    index_to_sample = rows(f"{base}_index_to_sample")
    assert index_to_sample == [np.flatnonzero(values == v).tolist() for v in distinct]
    merged = rows(f"{base}_index_to_sample_percentile_merged")
    step = max(1, len(distinct) // 100)
    assert (step > 1) == (metric == "tokensum")  # 205 distinct sums: pairs of rows merge
    flat = [s for samples in index_to_sample for s in samples]
    assert [s for samples in merged for s in samples] == flat
    assert [len(m) for m in merged] == [
        sum(map(len, index_to_sample[i:i + step])) for i in range(0, len(distinct), step)]
    assert open_index(f"{base}_index_to_sample").dtype == np.uint8  # 240 samples


def test_one_and_two_workers_write_deepspeeds_files(tmp_path):
    analyzer(tmp_path / "one").run_map_reduce()
    assert_same_as_deepspeed(tmp_path / "one")
    for worker in (1, 0):  # in any order: each worker its own split
        analyzer(tmp_path / "two", num_workers=2, worker_id=worker).run_map()
    analyzer(tmp_path / "two", num_workers=2, worker_id=0).run_reduce()
    assert_same_as_deepspeed(tmp_path / "two")


def _rank_main(rank: int, store: str, out: str) -> None:
    """One gloo rank: the fixture's job, then a job whose metric fails on rank 1."""
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    try:
        job = analyzer(Path(out) / "ranks")
        assert (job.num_workers, job.worker_id) == (2, rank)
        job.run_map_reduce()

        def failing(batch):
            if dist.get_rank() == 1:
                raise ValueError("bad sample")
            return syn.seqlen(batch)

        try:
            DataAnalyzer(syn.TokenDataset(), batch_size=8, metric_names=["seqlen"],
                         metric_functions=[failing], metric_types=["single_value_per_sample"],
                         save_path=Path(out) / "failed", collate_fn=syn.collate).run_map_reduce()
            outcome = "no error"
        except Exception as error:
            outcome = f"{type(error).__name__}: {error}"
        Path(out, f"rank{rank}.json").write_text(json.dumps(outcome))
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_write_the_files_of_one_rank_and_of_deepspeed(tmp_path):
    context = mp.start_processes(_rank_main, args=(str(tmp_path / "store"), str(tmp_path)),
                                 nprocs=2, join=False, start_method="fork")
    deadline = time.monotonic() + 60
    try:
        while not context.join(timeout=0.5):
            assert time.monotonic() < deadline, "the ranks did not finish in 60 s"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    assert_same_as_deepspeed(tmp_path / "ranks")
    analyzer(tmp_path / "alone").run_map_reduce()
    for rel in FILES:
        assert (tmp_path / "ranks" / rel).read_bytes() == (tmp_path / "alone" / rel).read_bytes()
    # a failure on one rank raises on both, instead of leaving rank 0 in a barrier
    assert json.loads((tmp_path / "rank1.json").read_text()) == "ValueError: bad sample"
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    assert rank0.startswith("RuntimeError: the data analyzer's map failed on rank(s) [1]")


class CrashOnce:
    """``function``, raising on the ``at``-th call (from 0) of its first run; counts calls."""

    def __init__(self, function, at: int | None):
        self.function, self.at, self.calls = function, at, 0

    def __call__(self, batch):
        if self.calls == self.at:
            self.at = None
            raise RuntimeError("worker killed")
        self.calls += 1
        return self.function(batch)


def test_an_interrupted_map_resumes_where_it_stopped(tmp_path):
    seqlen = CrashOnce(syn.seqlen, at=7)  # 15 batches of 16; progress saved every 2
    functions = [seqlen, *syn.METRIC_FUNCTIONS[1:]]
    job = analyzer(tmp_path, functions, progress_every=2)
    with pytest.raises(RuntimeError, match="worker killed"):
        job.run_map_reduce()
    progress = json.loads((tmp_path / MAP_DIR / "worker0" / "progress.json").read_text())
    assert (progress["batches"], progress["chunks"], progress["done"]) == (6, 3, False)
    with pytest.raises(UsageError, match="worker 0 of 1 has not finished") as info:
        job.run_reduce()
    assert "run run_map() with worker_id=0, num_workers=1" in str(info.value)

    seqlen.calls = 0
    job.run_map_reduce()
    assert seqlen.calls == 15 - 6  # the 6 saved batches are not mapped again
    assert_same_as_deepspeed(tmp_path)
    job.run_map_reduce()
    assert seqlen.calls == 9  # a finished map is not redone; the reduce writes the same files
    assert_same_as_deepspeed(tmp_path)


def test_a_crash_between_chunk_and_progress_redoes_that_chunk(tmp_path):
    seqlen = CrashOnce(syn.seqlen, at=None)
    analyzer(tmp_path, [seqlen, *syn.METRIC_FUNCTIONS[1:]], progress_every=4).run_map()
    state = tmp_path / MAP_DIR / "worker0"
    progress = json.loads((state / "progress.json").read_text())
    assert progress["chunks"] == 4  # 4 + 4 + 4 + 3 batches
    progress.update(batches=8, chunks=2, done=False)  # as if killed after chunk 2 was written
    (state / "progress.json").write_text(json.dumps(progress))
    (state / "chunk000002.npz.123.cafe.tmp").write_bytes(b"half")
    seqlen.calls = 0
    analyzer(tmp_path, [seqlen, *syn.METRIC_FUNCTIONS[1:]], progress_every=4).run_map_reduce()
    assert seqlen.calls == 7
    assert not list(state.glob("*.tmp"))
    assert_same_as_deepspeed(tmp_path)


def test_another_job_in_the_same_folder_starts_over(tmp_path):
    seqlen = CrashOnce(syn.seqlen, at=None)
    functions = [seqlen, *syn.METRIC_FUNCTIONS[1:]]
    analyzer(tmp_path, functions, batch_size=32).run_map()
    assert seqlen.calls == 8
    analyzer(tmp_path, functions).run_map_reduce()  # batches of 16: the old map is dropped
    assert seqlen.calls == 8 + 15
    analyzer(tmp_path, functions, resume=False).run_map()
    assert seqlen.calls == 8 + 15 + 15
    assert_same_as_deepspeed(tmp_path)


def test_sample_ids_from_sample_indices_or_the_batch(tmp_path):
    lengths = np.array([len(r) for r in syn.token_rows()])
    order = np.random.default_rng(0).permutation(len(lengths))
    DataAnalyzer(syn.TokenDataset(), batch_size=16, metric_names=["seqlen"],
                 metric_functions=[syn.seqlen], metric_types=["single_value_per_sample"],
                 save_path=tmp_path / "shuffled", collate_fn=syn.collate,
                 sample_indices=order.tolist()).run_map_reduce()
    base = tmp_path / "shuffled" / "seqlen" / "seqlen"
    assert rows(f"{base}_sample_to_metric") == [[n] for n in lengths]  # in map order
    assert rows(f"{base}_index_to_sample") == [order[lengths == v].tolist()
                                               for v in np.unique(lengths)]

    def with_index(batch):
        return {"index": torch.tensor([[100 + len(r)] for r in batch]), "rows": batch}

    DataAnalyzer(syn.TokenDataset(), batch_size=16, metric_names=["seqlen"],
                 metric_functions=[lambda b: syn.seqlen(b["rows"])],
                 metric_types=["single_value_per_sample"], save_path=tmp_path / "megatron",
                 collate_fn=with_index).run_map_reduce()
    got = rows(tmp_path / "megatron" / "seqlen" / "seqlen_index_to_sample")
    assert got == [[100 + v] * int((lengths == v).sum()) for v in np.unique(lengths)]


@pytest.mark.parametrize(("change", "message"), [
    (dict(metric_types=["single_value_per_sample", "per_token", "x", "y"]),
     "unknown metric type 'per_token'"),
    (dict(metric_names=["a", "a", "b", "c"]), "metric name 'a' cannot be a folder"),
    (dict(metric_names=["_map", "a", "b", "c"]), "metric name '_map' cannot be a folder"),
    (dict(metric_functions=[syn.seqlen]), "1 metric_functions for 4 metric_names"),
    (dict(metric_dtypes=[torch.int64]), "1 metric_dtypes for 4 metric_names"),
    (dict(metric_dtypes=[torch.float32] * 4), "cannot be stored in an index file"),
    (dict(num_workers=2, worker_id=2), "worker_id 2 is not one of num_workers 2"),
    (dict(batch_size=0), "batch_size must be a positive integer"),
])
def test_bad_arguments_are_usage_errors(tmp_path, change, message):
    with pytest.raises(UsageError, match=message):
        analyzer(tmp_path, **change)


@pytest.mark.parametrize(("function", "message"), [
    (lambda b: syn.seqlen(b).to(torch.int32), "returned int32 values, its dtype is int64"),
    (lambda b: syn.seqlen(b)[:-1], r"returned shape \(15,\) for a batch of 16 samples"),
    (lambda b: [len(r) for r in b], "returned a list"),
    (lambda b: syn.seqlen(b).float(), "cannot be stored in an index file"),
])
def test_bad_metric_results_are_usage_errors(tmp_path, function, message):
    with pytest.raises(UsageError, match=message):
        analyzer(tmp_path, [function, *syn.METRIC_FUNCTIONS[1:]]).run_map()


def test_two_workers_without_a_process_group_cannot_map_reduce(tmp_path):
    with pytest.raises(UsageError, match="needs a process group"):
        analyzer(tmp_path, num_workers=2, worker_id=0).run_map_reduce()


def test_a_damaged_map_state_is_a_usage_error(tmp_path):
    job = analyzer(tmp_path, progress_every=4)
    job.run_map()
    (tmp_path / MAP_DIR / "worker0" / "chunk000001.npz").write_bytes(b"not a zip")
    with pytest.raises(UsageError, match="map state of worker 0 is damaged") as info:
        job.run_reduce()
    assert "resume=False" in str(info.value)
    analyzer(tmp_path, progress_every=4, resume=False).run_map_reduce()
    assert_same_as_deepspeed(tmp_path)

"""Record DeepSpeed 0.19.8's curriculum schedules and data sampler as JSON fixtures.

Runs in a Python environment with DeepSpeed 0.19.8 (not deepshard's), on CPU::

    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python tests/data/data_efficiency/make_curriculum_fixture.py

Writes, next to this script:

- ``curriculum_schedule_ds0198.json``: ``CurriculumScheduler.get_difficulty`` and
  ``update_difficulty`` for steps 0..300 of each schedule config;
- ``curriculum_sampler_ds0198.json``: the micro-batches of sample ids (and the current
  difficulties with each) that ``DeepSpeedDataSampler`` yields on one rank, for seqlen-only,
  value-based, percentile-based and two-index-metric configs, with the index rows used
  (so that the test rebuilds the same index in memory, without DeepSpeed).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
STEPS = 300

SCHEDULES = {
    "discrete": {"min_difficulty": 1, "max_difficulty": 5, "schedule_type": "fixed_discrete",
                 "schedule_config": {"difficulty": [1, 2, 3, 5], "max_step": [10, 50, 120]}},
    "linear": {"min_difficulty": 64, "max_difficulty": 1024, "schedule_type": "fixed_linear",
               "schedule_config": {"total_curriculum_step": 200, "difficulty_step": 8}},
    "linear_min_below_step": {"min_difficulty": 8, "max_difficulty": 256,
                              "schedule_type": "fixed_linear",
                              "schedule_config": {"total_curriculum_step": 100,
                                                  "difficulty_step": 16}},
    "root2": {"min_difficulty": 64, "max_difficulty": 1024, "schedule_type": "fixed_root",
              "schedule_config": {"total_curriculum_step": 250, "difficulty_step": 8,
                                 "root_degree": 2}},
    "root3": {"min_difficulty": 80, "max_difficulty": 2048, "schedule_type": "fixed_root",
              "schedule_config": {"total_curriculum_step": 150, "difficulty_step": 16,
                                 "root_degree": 3}},
    "root2_min_not_multiple": {"min_difficulty": 10, "max_difficulty": 500,
                               "schedule_type": "fixed_root",
                               "schedule_config": {"total_curriculum_step": 200,
                                                  "difficulty_step": 16, "root_degree": 2}},
}


def record_schedules() -> dict:
    from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

    out = {}
    for name, config in SCHEDULES.items():
        getter = CurriculumScheduler(json.loads(json.dumps(config)))
        updater = CurriculumScheduler(json.loads(json.dumps(config)))
        out[name] = {"config": config,
                     "get_difficulty": [getter.get_difficulty(s) for s in range(STEPS + 1)],
                     "update_difficulty": [updater.update_difficulty(s)
                                           for s in range(STEPS + 1)]}
    return out


# ---- the sampler ----

N_SAMPLES = 120
MICRO, GAS = 4, 2
MICRO_BATCHES = 80

SEQLEN = {"difficulty_type": "value", "clustering_type": "single_cluster",
          "min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_linear",
          "schedule_config": {"total_curriculum_step": 20, "difficulty_step": 8}}
RARITY = {"difficulty_type": "value", "clustering_type": "schedule_based",
          "min_difficulty": 2, "max_difficulty": 9, "schedule_type": "fixed_discrete",
          "schedule_config": {"difficulty": [2, 5, 9], "max_step": [5, 12]}}
PERCENT = {"difficulty_type": "percentile", "clustering_type": "schedule_based",
           "min_difficulty": 10, "max_difficulty": 100, "schedule_type": "fixed_linear",
           "schedule_config": {"total_curriculum_step": 30, "difficulty_step": 10}}

SCENARIOS = {
    "seqlen_only": {"seqlen_truncate": SEQLEN},
    "value_index": {"vocabularyrarity": RARITY, "seqlen_truncate": SEQLEN},
    "percentile_index": {"lengthrank": PERCENT},
    "two_index_metrics": {"vocabularyrarity": RARITY, "lengthrank": PERCENT},
}


def make_indexes() -> dict:
    """Per index metric: rows of sample ids by metric value (ascending), and the values."""
    rng = np.random.default_rng(7)
    rarity = rng.integers(0, 10, N_SAMPLES)
    length = rng.permutation(N_SAMPLES)  # a distinct "length" per sample: percentiles
    indexes = {}
    for name, values in (("vocabularyrarity", rarity), ("lengthrank", length // 7)):
        distinct = np.unique(values)
        indexes[name] = {
            "index_to_sample": [np.flatnonzero(values == v).tolist() for v in distinct],
            "index_to_metric": [[int(v)] for v in distinct]}
    return indexes


def write_index(prefix: str, rows: list[list[int]], dtype) -> None:
    from deepspeed.runtime.data_pipeline.data_sampling.utils import (
        close_mmap_dataset_builder,
        create_mmap_dataset_builder,
    )

    builder = create_mmap_dataset_builder(prefix, dtype)
    for row in rows:
        builder.add_item_numpy(np.asarray(row, dtype=dtype))
        builder.end_document()
    close_mmap_dataset_builder(builder, prefix)


def make_sampler(metrics: dict, indexes: dict, workdir: str):
    import torch.distributed as tdist
    from deepspeed.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler

    metrics = json.loads(json.dumps(metrics))
    for name, metric in metrics.items():
        if metric["clustering_type"] == "single_cluster":
            continue
        sample_prefix = f"{workdir}/{name}_index_to_sample"
        metric_prefix = f"{workdir}/{name}_index_to_metric"
        write_index(sample_prefix, indexes[name]["index_to_sample"], np.int64)
        write_index(metric_prefix, indexes[name]["index_to_metric"], np.int64)
        metric["index_to_sample_path"] = sample_prefix
        metric["index_to_metric_path"] = metric_prefix
    config = {"seed": 1234, "data_sampling": {
        "num_epochs": 1000, "curriculum_learning": {
            "enabled": True, "data_cluster_path": f"{workdir}/clusters",
            "curriculum_metrics": metrics}}}
    group = tdist.new_group(ranks=[0])
    return DeepSpeedDataSampler(config, N_SAMPLES, MICRO, 0, 1, group, GAS, 0)


def draw(sampler, count: int) -> list[dict]:
    out = []
    for i, batch in enumerate(sampler):
        out.append({"ids": [int(x) for x in batch],
                    "difficulties": dict(sampler.state_dict()["current_difficulties"])})
        if i + 1 == count:
            break
    return out


def run_sampler(metrics: dict, indexes: dict, workdir: str) -> list[dict]:
    return draw(make_sampler(metrics, indexes, workdir), MICRO_BATCHES)


RESUME_AFTER, RESUMED = 11, 30


def run_resume(metrics: dict, indexes: dict, workdir: str) -> dict:
    """DeepSpeed's own resume: its state after RESUME_AFTER micro batches (without the
    global numpy state it also saves), its cluster files, and what a new sampler that loads
    the state yields next."""
    from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset

    first = make_sampler(metrics, indexes, workdir)
    draw(first, RESUME_AFTER)
    state = first.state_dict()
    saved = {k: v for k, v in state.items() if k != "np_rng_state"}
    saved = json.loads(json.dumps(saved, default=int))
    clusters = {}
    for name in state["data_cluster_paths"]:
        files = MMapIndexedDataset(f"{workdir}/clusters/{name}", skip_warmup=True)
        clusters[name] = [int(x) for x in np.array(files[0])]  # copied before files closes
        del files
    second = make_sampler(metrics, indexes, workdir)
    second.load_state_dict(state)
    return {"after": RESUME_AFTER, "state": saved, "cluster_files": clusters,
            "next": draw(second, RESUMED)}


def record_sampler() -> dict:
    import deepspeed
    import deepspeed.comm as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    deepspeed.init_distributed(dist_backend="gloo")
    dist.comm.cdb.shm_vector_kernel_level = 0
    indexes = make_indexes()
    scenarios = {}
    for name, metrics in SCENARIOS.items():
        with tempfile.TemporaryDirectory() as workdir:
            scenarios[name] = {"metrics": metrics,
                               "micro_batches": run_sampler(metrics, indexes, workdir)}
        if name == "value_index":
            with tempfile.TemporaryDirectory() as workdir:
                scenarios[name]["deepspeed_resume"] = run_resume(metrics, indexes, workdir)
    return {"deepspeed": deepspeed.__version__, "seed": 1234, "num_samples": N_SAMPLES,
            "micro_batch_size": MICRO, "gradient_accumulation_steps": GAS,
            "data_parallel_size": 1, "indexes": indexes, "scenarios": scenarios}


def main() -> None:
    import deepspeed

    schedules = {"deepspeed": deepspeed.__version__, "steps": STEPS,
                 "schedules": record_schedules()}
    (HERE / "curriculum_schedule_ds0198.json").write_text(json.dumps(schedules) + "\n")
    sampler = record_sampler()
    (HERE / "curriculum_sampler_ds0198.json").write_text(json.dumps(sampler) + "\n")
    print("wrote the schedule and sampler fixtures in", HERE)
    sys.stdout.flush()
    os._exit(0)  # DeepSpeed's CPU build sometimes aborts at teardown


if __name__ == "__main__":
    main()

"""The curriculum sampler against DeepSpeed 0.19.8's recorded sample ids, its resume, its
split among data-parallel ranks, and the seqlen metrics applied to batches."""

from __future__ import annotations

import copy
import io
import json
from collections import UserDict, namedtuple
from pathlib import Path

import numpy as np
import pytest
import torch

from deepshard.data_efficiency.curriculum import METRICS_PATH
from deepshard.data_efficiency.sampler import CurriculumSampler
from deepshard.data_efficiency.seqlen import post_process, reshape, sequence_length, truncate
from deepshard.errors import UsageError

FIXTURE = (Path(__file__).resolve().parents[2] / "data" / "data_efficiency"
           / "curriculum_sampler_ds0198.json")
RECORDED = json.loads(FIXTURE.read_text())
N = RECORDED["num_samples"]
TABLES = {f"{name}/{kind}": [np.asarray(row) for row in index[f"index_to_{kind}"]]
          for name, index in RECORDED["indexes"].items() for kind in ("sample", "metric")}


def open_index(path):
    """The recorded index rows, by the path prefix the config names."""
    return TABLES[path]


def config(scenario, **curriculum):
    metrics = copy.deepcopy(RECORDED["scenarios"][scenario]["metrics"])
    for name, metric in metrics.items():
        if metric["clustering_type"] != "single_cluster":
            metric["index_to_sample_path"] = f"{name}/sample"
            metric["index_to_metric_path"] = f"{name}/metric"
    return {"seed": RECORDED["seed"], "data_sampling": {"num_epochs": 1000, "curriculum_learning": {
        "enabled": True, "curriculum_metrics": metrics, **curriculum}}}


def sampler(scenario, micro=4, gas=2, rank=0, size=1, dataset_len=N, **curriculum):
    return CurriculumSampler.from_config(
        config(scenario, **curriculum), dataset_len=dataset_len, micro_batch_size=micro,
        gradient_accumulation_steps=gas, data_parallel_rank=rank, data_parallel_size=size,
        open_index=open_index)


def take(it, count):
    return [next(it) for _ in range(count)]


@pytest.mark.parametrize("scenario", sorted(RECORDED["scenarios"]))
def test_same_sample_ids_as_deepspeed(scenario):
    expected = RECORDED["scenarios"][scenario]["micro_batches"]
    s = sampler(scenario, micro=RECORDED["micro_batch_size"],
                gas=RECORDED["gradient_accumulation_steps"])
    it = iter(s)
    got = []
    for _ in expected:
        ids = next(it)
        got.append({"ids": ids, "difficulties": s.current_difficulties})
    assert got == expected


def test_only_eligible_samples():
    rarity = np.empty(N, dtype=np.int64)
    index = RECORDED["indexes"]["vocabularyrarity"]
    for row, (value,) in zip(index["index_to_sample"], index["index_to_metric"], strict=True):
        rarity[row] = value
    s = sampler("value_index")
    for ids in take(iter(s), 60):
        assert rarity[ids].max() <= s.current_difficulties["vocabularyrarity"]


def test_a_cluster_is_used_up_before_it_repeats():
    s = sampler("seqlen_only", micro=5, gas=3)  # one cluster: all samples
    ids = [i for batch in take(iter(s), 2 * N // 5) for i in batch]
    assert sorted(ids[:N]) == list(range(N)) and sorted(ids[N:]) == list(range(N))


def test_deepspeed_resume_from_its_cluster_files(tmp_path):
    record = RECORDED["scenarios"]["value_index"]["deepspeed_resume"]
    files = {f"{tmp_path}/{name}": [np.asarray(ids)]
             for name, ids in record["cluster_files"].items()}
    s = CurriculumSampler.from_config(
        config("value_index", data_cluster_path=str(tmp_path)), dataset_len=N,
        micro_batch_size=4, gradient_accumulation_steps=2,
        open_index=lambda path: files[path] if path in files else open_index(path))
    s.load_state_dict(record["state"])
    it = iter(s)
    got = []
    for _ in record["next"]:
        ids = next(it)
        got.append({"ids": ids, "difficulties": s.current_difficulties})
    assert got == record["next"]


def test_deepspeed_state_needs_the_cluster_directory():
    state = RECORDED["scenarios"]["value_index"]["deepspeed_resume"]["state"]
    with pytest.raises(UsageError, match="DeepSpeed's") as err:
        sampler("value_index").load_state_dict(state)
    assert err.value.where.endswith("curriculum_learning.data_cluster_path")


def _roundtrip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("scenario", ["seqlen_only", "value_index", "two_index_metrics"])
@pytest.mark.parametrize("after", [3, 8, 13])
def test_resume_continues_exactly(scenario, after):
    uninterrupted = iter(sampler(scenario))
    first = sampler(scenario)
    take(iter(first), after)
    state = _roundtrip(first.state_dict())
    take(iter(first), 5)  # the saved state must not follow the live sampler
    resumed = sampler(scenario)
    resumed.load_state_dict(state)
    take(uninterrupted, after)
    assert take(iter(resumed), 40) == take(uninterrupted, 40)


def test_resume_on_another_data_parallel_size():
    reference = iter(sampler("value_index", micro=4, gas=2))
    first = sampler("value_index", micro=4, gas=2)
    take(iter(first), 6)  # three whole global batches of 8
    state = first.state_dict()
    ranks = [sampler("value_index", micro=1, gas=2, rank=r, size=4) for r in range(4)]
    for r in ranks:
        r.load_state_dict(state)
    take(reference, 6)
    iters = [iter(r) for r in ranks]
    for _ in range(30):
        assert [i for it in iters for i in next(it)] == next(reference)


@pytest.mark.parametrize("scenario", ["seqlen_only", "percentile_index"])
def test_two_ranks_split_each_global_batch(scenario):
    whole = iter(sampler(scenario, micro=4, gas=2))
    rank0 = iter(sampler(scenario, micro=2, gas=2, rank=0, size=2))
    rank1 = iter(sampler(scenario, micro=2, gas=2, rank=1, size=2))
    for _ in range(40):
        a, b = next(rank0), next(rank1)
        assert len(a) == len(b) == 2 and a + b == next(whole)


def test_two_ranks_get_disjoint_samples():
    rank0 = iter(sampler("seqlen_only", micro=8, gas=4, rank=0, size=2, dataset_len=4096))
    rank1 = iter(sampler("seqlen_only", micro=8, gas=4, rank=1, size=2, dataset_len=4096))
    for _ in range(4):  # one global batch of 64, within the first pass over the cluster
        seen0 = {i for _ in range(4) for i in next(rank0)}
        seen1 = {i for _ in range(4) for i in next(rank1)}
        assert len(seen0) == len(seen1) == 32 and not seen0 & seen1


def test_custom_schedule_and_checks():
    cfg = config("seqlen_only")
    cfg["data_sampling"]["curriculum_learning"]["curriculum_metrics"]["seqlen_truncate"] = {
        "min_difficulty": 8, "max_difficulty": 64, "schedule_type": "custom"}
    s = CurriculumSampler.from_config(cfg, dataset_len=N, micro_batch_size=4)
    with pytest.raises(UsageError, match="no schedule function"):
        next(iter(s))
    s = CurriculumSampler.from_config(cfg, dataset_len=N, micro_batch_size=4)
    s.set_custom_curriculum_learning_schedule({"seqlen_truncate": lambda step: 8 * step,
                                              "not_a_metric": len})
    it = iter(s)
    assert [(next(it), s.current_difficulties["seqlen_truncate"])[1] for _ in range(9)] == \
        [8, 16, 24, 32, 40, 48, 56, 64, 64]
    assert len(s) == N * 1000 // 4


def test_stops_after_num_epochs():
    cfg = config("seqlen_only")
    cfg["data_sampling"]["num_epochs"] = 1
    cfg["seed"] = 0
    s = CurriculumSampler.from_config(cfg, dataset_len=N, micro_batch_size=4,
                                      gradient_accumulation_steps=2)
    assert len(s) == len(list(s)) == N // 4 and list(s) == []


def test_no_eligible_sample_is_a_usage_error():
    cfg = config("value_index")
    metric = cfg["data_sampling"]["curriculum_learning"]["curriculum_metrics"]["vocabularyrarity"]
    metric["schedule_config"]["difficulty"] = [-1, 5, 9]
    s = CurriculumSampler.from_config(cfg, dataset_len=N, micro_batch_size=4,
                                      open_index=open_index)
    with pytest.raises(UsageError, match="no sample is eligible") as err:
        next(iter(s))
    assert err.value.where == METRICS_PATH


def test_state_of_other_metrics_or_data_is_refused():
    state = sampler("value_index").state_dict()
    take(iter(other := sampler("value_index")), 2)
    with pytest.raises(UsageError, match="curriculum metrics"):
        sampler("seqlen_only").load_state_dict(other.state_dict())
    with pytest.raises(UsageError, match="samples"):
        sampler("value_index", dataset_len=N + 1).load_state_dict(state)


def test_clusters_written_for_inspection(tmp_path):
    s = sampler("value_index", data_cluster_path=str(tmp_path / "clusters"))
    take(iter(s), 12)
    written = sorted(p.name for p in (tmp_path / "clusters").iterdir())
    assert written == [f"{name}.npy" for name in sorted(s.state_dict()["data_cluster_paths"])]
    first = np.load(tmp_path / "clusters" / written[0])
    assert len(first) == len(s.state_dict()["data_clusters"][0])


# ---- the seqlen metrics ----


def test_truncate_tuple_of_tensors():
    x, y = torch.arange(24).view(2, 12), torch.arange(24).view(2, 12) + 1
    cx, cy = truncate((x, y), 5)
    assert torch.equal(cx, x[:, :5]) and torch.equal(cy, y[:, :5]) and cx.is_contiguous()
    assert truncate([x, y], 20)[0] is x  # not longer: unchanged


def test_truncate_dict_batches():
    batch = {"labels_per_sample": torch.tensor([1, 0]), "input_ids": torch.ones(2, 10),
             "attention_mask": torch.ones(2, 10), "labels": torch.ones(2, 10),
             "position_ids": torch.arange(10).expand(2, 10), "mask4d": torch.ones(2, 1, 10, 10),
             "meta": "kept"}
    out = truncate(batch, 4)
    assert {k: tuple(v.shape) for k, v in out.items() if torch.is_tensor(v)} == {
        "labels_per_sample": (2,), "input_ids": (2, 4), "attention_mask": (2, 4),
        "labels": (2, 4), "position_ids": (2, 4), "mask4d": (2, 1, 10, 10)}
    assert out["meta"] == "kept"

    class Encoding(UserDict):
        pass

    assert isinstance(truncate(Encoding(batch), 4), Encoding)
    Pair = namedtuple("Pair", "x y")
    pair = truncate(Pair(torch.ones(3, 8), torch.ones(3, 8, 2)), 2)
    assert isinstance(pair, Pair) and pair.y.shape == (3, 2, 2)


def test_sequence_length_prefers_input_ids():
    assert sequence_length({"pixel": torch.ones(2, 3, 4), "input_ids": torch.ones(2, 7)}) == 7
    assert sequence_length({"n": 3, "v": torch.ones(5)}) is None


def test_reshape():
    x = torch.arange(2 * 10).view(2, 10)
    batch = {"input_ids": x, "labels": x + 100, "weight": torch.tensor([0.5, 2.0])}
    out = reshape(batch, 4)  # 10 // 4 = 2 rows per sample, 2 positions dropped
    assert out["input_ids"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7],
                                         [10, 11, 12, 13], [14, 15, 16, 17]]
    assert torch.equal(out["labels"], out["input_ids"] + 100)
    assert out["weight"].tolist() == [0.5, 0.5, 2.0, 2.0]


def test_post_process_uses_the_sampler_state():
    s = sampler("value_index")
    batch = (torch.ones(4, 64, dtype=torch.long), torch.ones(4, 64, dtype=torch.long))
    next(iter(s))
    x, y = post_process(batch, s.state_dict())
    assert x.shape == y.shape == (4, 8)
    folded = post_process({"input_ids": torch.ones(2, 64)},
                          {"current_difficulties": {"seqlen_reshape": 16}})
    assert folded["input_ids"].shape == (8, 16)
    assert post_process(batch, {"current_difficulties": {"vocabularyrarity": 3}}) is batch

"""DeepSpeed's elasticity arithmetic, against DeepSpeed's own outputs.

EXPECTED was computed on 2026-12-02 by DeepSpeed 0.18.9's
``deepspeed.elasticity.compute_elastic_config(config, "0.18.9", world_size=W)`` (the last
release with elasticity: 0.19 removed it and rejects the section), run from its sdist with
numpy in /tmp/dsvenv; an error is recorded by its exception's name. Valid world sizes are
written as "a,b,c".
"""

from __future__ import annotations

import pytest

from deepshard.elasticity import ElasticSpec, allows, compute, fits_batch, spec_from_mapping
from deepshard.errors import UsageError

CONFIGS = [
    {"max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "version": 0.1},
    {"max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "version": 0.1,
     "prefer_larger_batch": False},
    {"max_train_batch_size": 100, "micro_batch_sizes": [1, 2], "min_gpus": 2,
     "max_gpus": 8, "version": 0.1},
    {"max_train_batch_size": 12, "micro_batch_sizes": [1], "version": 0.1},
    {"max_train_batch_size": 48, "micro_batch_sizes": [3, 5], "version": 0.1},
    {"max_train_batch_size": 7, "micro_batch_sizes": [8], "version": 0.1},
    {"max_train_batch_size": 64, "micro_batch_sizes": [16, 32], "min_gpus": 1,
     "max_gpus": 4, "version": 0.1},
    {"max_train_batch_size": 1000, "micro_batch_sizes": [2, 4], "num_gpus_per_node": 2,
     "max_gpus": 16, "version": 0.2},
    {"max_train_batch_size": 1000, "micro_batch_sizes": [2, 4], "num_gpus_per_node": 4,
     "model_parallel_size": 2, "max_gpus": 32, "version": 0.2},
    {"max_train_batch_size": 60, "micro_batch_sizes": [1, 3], "version": 0.2},
    {"max_train_batch_size": 60, "micro_batch_sizes": [1, 3], "version": 0.2,
     "prefer_larger_batch": False},
    {"max_train_batch_size": 24, "micro_batch_sizes": [2], "num_gpus_per_node": 4, "min_gpus": 4,
     "max_gpus": 12, "version": 0.2},
]

# the divisors of 1680 that DeepSpeed's v0.1 arithmetic allows for configs 0 and 1
V1680 = ("1,2,3,4,5,6,7,8,10,12,14,15,20,21,24,28,30,35,40,42,56,60,70,84,105,120,140,168,"
         "210,280,420,840")

# (config index, world size, train batch or error, valid world sizes, micro batch)
EXPECTED = [
    (0, 1, 1680, V1680, 6),
    (0, 2, 1680, V1680, 6),
    (0, 3, 1680, V1680, 4),
    (0, 4, 1680, V1680, 6),
    (0, 6, 1680, V1680, 4),
    (0, 8, 1680, V1680, 6),
    (0, 12, 1680, V1680, 4),
    (1, 1, 1680, V1680, 6),
    (1, 2, 1680, V1680, 6),
    (1, 3, 1680, V1680, 4),
    (1, 4, 1680, V1680, 6),
    (1, 6, 1680, V1680, 4),
    (1, 8, 1680, V1680, 6),
    (1, 12, 1680, V1680, 4),
    (2, 1, 'ElasticityIncompatibleWorldSize', None, None),
    (2, 2, 96, '2,3,4,6,8', 2),
    (2, 3, 96, '2,3,4,6,8', 2),
    (2, 4, 96, '2,3,4,6,8', 2),
    (2, 6, 96, '2,3,4,6,8', 2),
    (2, 8, 96, '2,3,4,6,8', 2),
    (2, 12, 'ElasticityIncompatibleWorldSize', None, None),
    (3, 1, 12, '1,2,3,4,6,12', 1),
    (3, 2, 12, '1,2,3,4,6,12', 1),
    (3, 3, 12, '1,2,3,4,6,12', 1),
    (3, 4, 12, '1,2,3,4,6,12', 1),
    (3, 6, 12, '1,2,3,4,6,12', 1),
    (3, 8, 'ElasticityIncompatibleWorldSize', None, None),
    (3, 12, 12, '1,2,3,4,6,12', 1),
    (4, 1, 36, '1,2,3,4,6,12', 3),
    (4, 2, 36, '1,2,3,4,6,12', 3),
    (4, 3, 36, '1,2,3,4,6,12', 3),
    (4, 4, 36, '1,2,3,4,6,12', 3),
    (4, 6, 36, '1,2,3,4,6,12', 3),
    (4, 8, 'ElasticityIncompatibleWorldSize', None, None),
    (4, 12, 36, '1,2,3,4,6,12', 3),
    (5, 1, 'ValueError', None, None),
    (5, 2, 'ValueError', None, None),
    (5, 3, 'ValueError', None, None),
    (5, 4, 'ValueError', None, None),
    (5, 6, 'ValueError', None, None),
    (5, 8, 'ValueError', None, None),
    (5, 12, 'ValueError', None, None),
    (6, 1, 64, '1,2,4', 32),
    (6, 2, 64, '1,2,4', 32),
    (6, 3, 'ElasticityIncompatibleWorldSize', None, None),
    (6, 4, 64, '1,2,4', 16),
    (6, 6, 'ElasticityIncompatibleWorldSize', None, None),
    (6, 8, 'ElasticityIncompatibleWorldSize', None, None),
    (6, 12, 'ElasticityIncompatibleWorldSize', None, None),
    (7, 1, 1000, '1', 4),
    (7, 2, 960, '2,4,6,8,10,12,16', 4),
    (7, 3, 996, '3', 4),
    (7, 4, 960, '2,4,6,8,10,12,16', 4),
    (7, 6, 960, '2,4,6,8,10,12,16', 4),
    (7, 8, 960, '2,4,6,8,10,12,16', 4),
    (7, 12, 960, '2,4,6,8,10,12,16', 4),
    (8, 1, 'ElasticityIncompatibleWorldSize', None, None),
    (8, 2, 'ElasticityIncompatibleWorldSize', None, None),
    (8, 3, 'ElasticityIncompatibleWorldSize', None, None),
    (8, 4, 960, '2,4,6,8,10,12,16', 4),
    (8, 6, 'ElasticityIncompatibleWorldSize', None, None),
    (8, 8, 960, '2,4,6,8,10,12,16', 4),
    (8, 12, 960, '2,4,6,8,10,12,16', 4),
    (9, 1, 60, '1,2,3,4,5,6,10,12,15,20,30,60', 3),
    (9, 2, 60, '1,2,3,4,5,6,10,12,15,20,30,60', 3),
    (9, 3, 60, '1,2,3,4,5,6,10,12,15,20,30,60', 1),
    (9, 4, 60, '1,2,3,4,5,6,10,12,15,20,30,60', 3),
    (9, 6, 60, '1,2,3,4,5,6,10,12,15,20,30,60', 1),
    (9, 8, 56, '8', 1),
    (9, 12, 60, '1,2,3,4,5,6,10,12,15,20,30,60', 1),
    (10, 1, 60, '1,2,3,4,5,6,10,12,15,20,30,60', 3),
    (10, 2, 60, '1,2,3,4,5,6,10,12,15,20,30,60', 3),
    (10, 3, 60, '1,2,3,4,5,6,10,12,15,20,30,60', 1),
    (10, 4, 60, '1,2,3,4,5,6,10,12,15,20,30,60', 3),
    (10, 6, 60, '1,2,3,4,5,6,10,12,15,20,30,60', 1),
    (10, 8, 48, '8', 3),
    (10, 12, 60, '1,2,3,4,5,6,10,12,15,20,30,60', 1),
    (11, 1, 24, '1', 2),
    (11, 2, 24, '2', 2),
    (11, 3, 24, '3', 2),
    (11, 4, 16, '4,8', 2),
    (11, 6, 24, '6', 2),
    (11, 8, 16, '4,8', 2),
    (11, 12, 24, '12', 2),
]



def spec(index: int) -> ElasticSpec:
    return spec_from_mapping({"enabled": True, **CONFIGS[index]})


@pytest.mark.parametrize(("index", "world", "batch", "valid", "micro"), EXPECTED)
def test_compute_matches_deepspeed(index, world, batch, valid, micro):
    if isinstance(batch, str):  # DeepSpeed raised: a one-line UsageError here
        with pytest.raises(UsageError):
            compute(spec(index), world)
        assert not allows(spec(index), world)
        return
    result = compute(spec(index), world)
    assert (result.train_batch_size, result.micro_batch_size) == (batch, micro)
    assert ",".join(map(str, result.valid_world_sizes)) == valid
    assert allows(spec(index), world)
    assert result.accumulation(world) * micro * world == batch


def test_bad_sections_name_the_key():
    with pytest.raises(UsageError, match=r"elasticity\.micro_batch_sizes"):
        spec_from_mapping({"enabled": True, "max_train_batch_size": 8,
                           "micro_batch_sizes": [0]})
    with pytest.raises(UsageError, match="needs max_train_batch_size and micro_batch_sizes"):
        spec_from_mapping({"enabled": True, "micro_batch_sizes": [2]})
    with pytest.raises(UsageError, match=r"elasticity\.min_gpu"):
        spec_from_mapping({"enabled": True, "max_train_batch_size": 8,
                           "micro_batch_sizes": [2], "min_gpu": 1})
    with pytest.raises(UsageError, match="does not support model parallelism"):
        compute(spec_from_mapping({"enabled": True, "max_train_batch_size": 8,
                                   "micro_batch_sizes": [2], "version": 0.1,
                                   "model_parallel_size": 2}), 2)
    with pytest.raises(UsageError, match="max_gpus 1 is below min_gpus 2"):
        compute(ElasticSpec(enabled=True, min_gpus=2, max_gpus=1), 2)


def test_fits_batch_keeps_the_micro_batch():
    assert [w for w in range(1, 13) if fits_batch(12, 2, w)] == [1, 2, 3, 6]
    assert not fits_batch(12, 2, 0)


def test_the_batch_stays_within_the_cap():
    """DeepSpeed 0.18.9 returned 120 for a cap of 100 (the micro sizes' least common
    multiple, kept although over the cap); upstream's fixed v0.1 algorithm (DeepSpeed
    #8237, run on this machine: candidates 60, 72, 96) gives 96 at GPU counts
    1, 2, 3, 4, 6, 8, 12."""
    spec = ElasticSpec(enabled=True, max_train_batch_size=100, micro_batch_sizes=(8, 10, 12),
                       version=0.1)
    got = compute(spec, 4)
    assert got.train_batch_size == 96
    assert got.valid_world_sizes == (1, 2, 3, 4, 6, 8, 12)

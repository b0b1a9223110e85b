"""What DeepSpeed's own unit tests found different (issue 41), each checked against
DeepSpeed 0.19.8 on this machine (2 gloo ranks, ``DS_ACCELERATOR=cpu``) and written here
as what it did; one job runs every case (``scripts/ds_unit_findings.py``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.compat.common import run_compat


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> list[dict]:
    return run_compat("ds_unit_findings.py", tmp_path_factory.mktemp("findings"))


def test_tensors_taken_inside_gathered_parameters_outlive_the_block(seen):
    """DeepSpeed 0.19.8: after the block ``p.data`` is empty again, but a ``state_dict()``
    and ``p.data`` references taken inside keep their full shapes and values (a snapshot;
    ``free_param`` rebinds ``.data``). deepshard freed the buffer in place: summing them
    killed the worker."""
    for rank in seen:
        assert rank["gathered_shapes"] == [(8, 8), (8,), (8, 8), (8,), (4, 8), (4,)]
        assert rank["released"] == [0] * 6
        assert rank["gathered_sums"] == rank["gathered_data_sums"]
        assert any(abs(s) > 0 for s in rank["gathered_sums"])
    assert seen[0]["gathered_sums"] == seen[1]["gathered_sums"]


def test_zero3_parameters_carry_deepspeed_s_attributes(seen):
    """DeepSpeed 0.19.8: ``ds_status`` NOT_AVAILABLE between uses and AVAILABLE inside
    ``GatheredParameters``; ``ds_id`` numbers the parameters; ``ds_shape``/``ds_numel`` the
    full size; ``ds_tensor`` this rank's part (the two ranks' parts add up to the model)."""
    for rank in seen:
        assert rank["ds_ids"] == list(range(6))
        assert (rank["status_between"], rank["status_gathered"], rank["status_after"]) == (
            "NOT_AVAILABLE", "AVAILABLE", "NOT_AVAILABLE")
        assert rank["ds_shape"] == (4, 8) and rank["ds_numel"] == 32 and rank["status_enum"]
    assert seen[0]["ds_tensor_numel"] + seen[1]["ds_tensor_numel"] == 2 * 72 + 36


def test_zero_init_casts_through_the_patchable_constructor_wrapper(seen):
    """DeepSpeed 0.19.8's ``zero.Init`` with a bf16 config makes ``torch.zeros`` and
    ``torch.arange(3.0)`` bf16 inside; transformers replaces
    ``partition_parameters.zero_wrapper_for_fp_tensor_constructor`` to leave ``arange``
    alone, and the replacement is honoured; constructors are torch's again after."""
    for rank in seen:
        assert rank["init_zeros"] == rank["init_arange"] == "torch.bfloat16"
        assert rank["patched_arange"] == "torch.float32"
        assert rank["patched_zeros"] == "torch.bfloat16"
        assert rank["after_init"] == "torch.float32"


def test_gradient_allreduce_op_sum_sums(seen):
    """DeepSpeed 0.19.8, ranks' gradients 1 and 2: the step moves a weight by 1.5 with
    'mean' (the default) and 3.0 with 'sum', at stages 0, 1 and 2; 'sum' at stage 3 is
    refused. deepshard accepted 'sum' and averaged (2x off on 2 ranks)."""
    for rank in seen:
        for stage in (0, 1, 2):
            assert rank[f"allreduce_mean_{stage}"] == pytest.approx(1.5), stage
            assert rank[f"allreduce_sum_{stage}"] == pytest.approx(3.0), stage
        assert rank["allreduce_sum_3"].startswith("refused")
        assert "gradient_allreduce_op" in rank["allreduce_sum_3"]


def test_the_engine_delegates_unknown_attributes_to_the_module(seen):
    """DeepSpeed 0.19.8: ``engine.magic(3)`` calls the model's method, ``engine.moe_1`` is
    the submodule; a name neither has is an AttributeError naming the engine."""
    for rank in seen:
        assert rank["magic"] == "magic 3" and rank["head_is_module"]
        assert "object has no attribute 'nonexistent'" in rank["missing"]


def test_save_checkpoint_without_a_directory_is_a_value_error(seen):
    """DeepSpeed 0.19.8: ``ValueError: save_dir must be a non-empty string, got None``
    (and ``''``)."""
    for rank in seen:
        assert rank["save_None"] == rank["save_''"] == "UsageValueError"


def test_parameters_used_outside_their_module_are_gathered(seen):
    """DeepSpeed 0.19.8 (2 ranks, SGD, same data on both): a parameter read outside its
    own module's forward trains exactly as plain torch without
    ``register_external_parameter`` (its ZeROOrderedDict gathers it on access during the
    engine's forward): the parent reading a child's weight, and a module reading a
    sibling's. So does deepshard's: each partitioned module's ``_parameters`` tells the
    coordinator, which gathers the group until backward has its gradients (without grad:
    until the forward ends)."""
    for r in seen:
        for case in ("ext_ExtLinear", "ext_Sibling"):
            got = r[case]
            assert got["got"] == pytest.approx(got["want"], rel=1e-5), case
            assert got["released"] == [0] * len(got["released"]), case


def test_allreduce_gradients_reduces_once(seen):
    """DeepSpeed 0.19.8's ``engine.allreduce_gradients()`` (what its backward calls) averages
    the ranks' gradients; deepshard reduces during backward, so the call reduces only what
    a ``no_sync`` backward left: 1.5 for gradients 1 and 2 either way, never 0.75 or 3."""
    for r in seen:
        for stage in (0, 1):
            for sync in (True, False):
                assert r[f"allreduce_gradients_{stage}_{sync}"] == 1.5, (stage, sync)


def test_ranks_saving_under_different_tags(seen):
    """DeepSpeed 0.19.8 (ZeRO-1, tags ``tag_rank<r>``): ``FAIL`` raises AssertionError on
    both ranks and writes nothing; ``WARN`` (the default) logs and ``IGNORE`` says nothing,
    and both save each rank's files under its own tag (``tag_rank0/`` with the model and
    rank 0's optimizer file, ``tag_rank1/`` with rank 1's; ``latest`` = ``tag_rank0``): a
    checkpoint no load restores. deepshard refuses the same way for ``FAIL`` and saves
    under rank 0's tag for the other two (deliberately: a checkpoint that loads)."""
    for r in seen:
        fail = r["tags_FAIL"]
        assert fail["error"] == "AssertionError" and "tag_rank0" in fail["message"]
        assert fail["written"] == []
        for mode in ("Warn", "ignore"):
            assert "tag_rank0" in r[f"tags_{mode}"]["saved"]
            assert "tag_rank1" not in r[f"tags_{mode}"]["saved"]
            assert r[f"tags_{mode}"]["loaded"] == "tag_rank0"


def test_a_sparse_embedding_bag_trains_like_a_dense_reference(seen):
    """DeepSpeed 0.19.8: ``EmbeddingBag(sparse=True)`` trains at stage 0 (sparse
    all-reduce; losses equal a dense reference averaging both ranks' gradients) and fails
    at stage 2 (``aten::view`` on a sparse tensor); the ``sparse_gradients`` key is a
    DeepSpeedConfigError there (deepshard warns that it is ignored: the reduction is the
    same sum either way). deepshard reduces the sparse gradient dense, at stages 0-2."""
    for r in seen:
        for stage in (0, 1, 2):
            case = r[f"sparse_bag_{stage}"]
            assert case["got"] == pytest.approx(case["want"], rel=1e-5), stage


def test_misuse_deepspeed_asserts_on_is_catchable_as_assertion_error(seen):
    """DeepSpeed 0.19.8 raises AssertionError for ``no_sync`` at stage 3, entering it
    twice, ``step()`` inside it, and ``initialize(model=None)``; deepshard keeps its one
    line, as an ``AssertionError`` too."""
    for rank in seen:
        for key in ("no_sync_stage3", "model_none", "no_sync_twice", "step_in_no_sync"):
            assert rank[key] == "AssertionError", key


def test_dist_init_required_false_without_a_process_group_fails_at_once(tmp_path):
    """DeepSpeed 0.19.8: ``AssertionError: Distributed backend is not initialized...`` in
    0.01 s; deepshard waited for a rendezvous that never came."""
    code = ("import torch, deepshard\n"
            "try:\n"
            "    deepshard.initialize(model=torch.nn.Linear(2, 2), dist_init_required=False,\n"
            "                         config={'train_micro_batch_size_per_gpu': 1})\n"
            "except AssertionError as exc:\n"
            "    print('AssertionError', 'dist_init_required' in str(exc))\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, text=True,
                         capture_output=True, timeout=60)
    assert out.stdout.split() == ["AssertionError", "True"], out.stderr[-2000:]


def test_public_names_deepspeed_s_tests_import(tmp_path):
    """DeepSpeed 0.19.8: ``git_version_info.version`` '0.19.8', ``git_hash`` and
    ``__git_hash__`` 'unknown', ``__version_major__`` 0; ``DeepSpeedConfig({...})`` built
    without a process group (world size 1): train_batch_size 8 -> micro 8, accumulation 1,
    ``zero_enabled``, ``zero_optimization_stage`` 2, ``bfloat16_config.enabled``, clipping
    1.0; a bad batch triad raises (deepshard: ``DeepSpeedConfigError``, its UsageError)."""
    from deepshard.compat import distribution
    from deepshard.contract import SHIM_DIR

    code = (
        "import deepspeed\n"
        "from deepspeed import git_version_info as v\n"
        "from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError\n"
        "print(v.version, v.git_hash, deepspeed.__git_hash__, deepspeed.__version_major__)\n"
        "c = DeepSpeedConfig({'train_batch_size': 8, 'bf16': {'enabled': True},\n"
        "                     'zero_optimization': {'stage': 2}})\n"
        "print(c.train_batch_size, c.train_micro_batch_size_per_gpu,\n"
        "      c.gradient_accumulation_steps, c.zero_enabled, c.zero_optimization_stage,\n"
        "      c.bfloat16_config.enabled, c.gradient_clipping)\n"
        "try:\n"
        "    DeepSpeedConfig({'train_batch_size': 8, 'train_micro_batch_size_per_gpu': 3})\n"
        "except deepspeed.DeepSpeedConfigError:\n"
        "    same = DeepSpeedConfigError is deepspeed.DeepSpeedConfigError\n"
        "    print('DeepSpeedConfigError', same)\n")
    env = dict(os.environ, PYTHONPATH=SHIM_DIR)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, text=True,
                         capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0].split() == [distribution.VERSION, "unknown", "unknown", "0"]
    assert lines[1].split() == ["8", "8", "1", "True", "2", "True", "1.0"]
    assert lines[2].split() == ["DeepSpeedConfigError", "True"]

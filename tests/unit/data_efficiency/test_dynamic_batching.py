"""Dynamic batching against DeepSpeed 0.19.8's recorded plans, learning rates and loaders
(``make_batching_fixture.py``), and its own guarantees: token budgets kept, every batch
trained once over the data-parallel ranks, a scheduler state that resumes exactly."""

from __future__ import annotations

import copy
import io
import json
import logging
import types
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepshard.data_efficiency.dynamic_batching import (
    KEY,
    VariableBatchSizeLR,
    batch_by_seqlens,
    build_variable_batch_size,
    dataloader_for_variable_batch_size,
    dynamic_batching_settings,
    get_dataloader_and_lr_scheduler_for_variable_batch_size,
    get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed,
    load_dataset_seqlens,
    lr_scheduler_for_variable_batch_size,
    plan_arithmetic,
    plan_batches,
    plan_summary,
    scale_lr,
)
from deepshard.errors import UsageError

FIXTURE = (Path(__file__).resolve().parents[2] / "data" / "data_efficiency"
           / "dynamic_batching_ds0198.json")
RECORDED = json.loads(FIXTURE.read_text())


def _as_lists(result):
    ids, sizes, max_seqlens = result
    return [[b, list(m)] for b, m in ids], list(sizes), list(max_seqlens)


# --- the plan --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(RECORDED["batch"]))
def test_batch_by_seqlens_equals_deepspeed(name):
    record = RECORDED["batch"][name]
    got = _as_lists(batch_by_seqlens(**record["args"]))
    assert got == (record["microbatch_ids"], record["batch_sizes"], record["batch_max_seqlens"])


def test_fixture_covers_orders_limits_and_equal_sizes():
    args = [r["args"] for r in RECORDED["batch"].values()]
    assert {a.get("sequence_picking_order", "dataloader") for a in args} == {
        "dataloader", "seqlen", "random"}
    assert any(a.get("min_batch_size", 1) > 1 for a in args)
    assert any(a.get("max_batch_size") for a in args)
    assert any(a.get("required_microbatches_of_same_size") for a in args)
    assert any(a.get("sequence_ids_per_mb") for a in args)
    assert any(max(a["seqlens"]) > a["max_tokens"] for a in args)


@pytest.mark.parametrize("name", sorted(RECORDED["departures"]))
def test_unplaceable_sample_is_skipped_where_deepspeed_ends_the_epoch(name, caplog):
    record = RECORDED["departures"][name]
    args = dict(record["args"])
    plan = plan_batches(args.pop("seqlens"), args.pop("max_tokens"), **args)
    ds_count = len(record["microbatch_ids"])
    # DeepSpeed's plan is a prefix of ours; ours goes on past the sample it stops at
    assert [[b, m] for b, m in plan.microbatch_ids()[:ds_count]] == record["microbatch_ids"]
    assert list(plan.batch_sizes[:len(record["batch_sizes"])]) == record["batch_sizes"]
    assert plan.num_batches > len(record["batch_sizes"])
    assert plan.skipped_ids
    with caplog.at_level(logging.WARNING):
        batch_by_seqlens(**record["args"])
    assert "start no micro-batch" in caplog.text


def test_too_long_samples_are_left_out_with_one_warning(caplog):
    seqlens = [3, 50, 4, 60, 5, 6, 2, 1]
    with caplog.at_level(logging.WARNING):
        ids, _, _ = batch_by_seqlens(seqlens, 10, effective_batch_size=1)
    used = {i for _, m in ids for i in m}
    assert not used & {1, 3}
    assert caplog.text.count("longer than max_tokens=10") == 1 and "[1, 3]" in caplog.text


@settings(max_examples=150, deadline=None)
@given(seqlens=st.lists(st.integers(0, 30), min_size=1, max_size=120),
       max_tokens=st.integers(1, 60), size=st.integers(1, 4), low=st.integers(0, 3),
       extra=st.one_of(st.none(), st.integers(0, 6)), same=st.booleans(),
       order=st.sampled_from(["dataloader", "seqlen", "random"]))
def test_plan_keeps_every_limit(seqlens, max_tokens, size, low, extra, same, order):
    high = None if extra is None else max(low, 1) + extra
    try:
        plan = plan_batches(seqlens, max_tokens, min_batch_size=low, max_batch_size=high,
                            sequence_picking_order=order, effective_batch_size=size,
                            required_microbatches_of_same_size=same, seed=5)
    except UsageError as error:
        assert "fewer than the" in str(error)
        return
    used = Counter(i for mb in plan.microbatches for i in mb)
    assert max(used.values()) == 1
    left_out = (set(plan.too_long_ids) | set(plan.skipped_ids) | set(plan.leftover_ids)
                | set(plan.trimmed_ids))
    assert set(used) | left_out == set(range(len(seqlens))) and not set(used) & left_out
    assert len(plan.microbatches) == plan.num_batches * size
    for mb, tokens in zip(plan.microbatches, plan.microbatch_tokens, strict=True):
        assert tokens == sum(seqlens[i] for i in mb) <= max_tokens
        assert max(low, 1) <= len(mb) <= (high or len(mb))
    for b in range(plan.num_batches):
        batch = plan.microbatches[b * size:(b + 1) * size]
        assert plan.batch_sizes[b] == sum(len(mb) for mb in batch)
        assert plan.batch_max_seqlens[b] == max(seqlens[i] for mb in batch for i in mb)
        if same:
            assert len({len(mb) for mb in batch}) == 1


def test_plan_arguments_are_checked():
    with pytest.raises(UsageError, match="sequence_picking_order"):
        plan_batches([1, 2, 3], 10, sequence_picking_order="shortest")
    with pytest.raises(UsageError, match="dataset_seqlens: sample 1 has length -2"):
        plan_batches([1, -2, 3], 10)
    with pytest.raises(UsageError, match="dataset_filter_ids"):
        plan_batches([1, 2, 3], 10, sequence_ids=[0, 7])
    with pytest.raises(UsageError, match="max_batch_size 1 is below min_batch_size 2"):
        plan_batches([1, 2, 3], 10, min_batch_size=2, max_batch_size=1)
    with pytest.raises(UsageError, match="fewer than the 4 of one batch"):
        plan_batches([5] * 6, 10, effective_batch_size=4)


def test_arithmetic_and_summary():
    plan = plan_batches([4, 6, 3, 7, 2, 8, 5, 5, 1, 9, 3, 3, 1], 10, effective_batch_size=4)
    rows = plan_arithmetic(plan, dp_world_size=2, lr_scaling_method="sqrt")
    assert [r.sequences for r in rows] == list(plan.batch_sizes)
    for row in rows:
        tokens = plan.microbatch_tokens[row.batch_id * 4:(row.batch_id + 1) * 4]
        assert row.tokens == sum(tokens) == sum(row.tokens_per_rank)
        assert row.tokens_per_rank == (tokens[0] + tokens[2], tokens[1] + tokens[3])
        assert row.micro_batches_per_rank == 2
        assert row.lr_multiplier == pytest.approx((row.sequences / 4) ** 0.5)
    line = plan_summary(plan)
    tokens = sum(plan.microbatch_tokens)
    assert f"{plan.num_batches} batches of 4 micro-batches" in line
    assert f"tokens {tokens} = {tokens / (plan.num_batches * 40):.1%}" in line
    assert "\n" not in line
    with pytest.raises(UsageError, match="dp_world_size"):
        plan_arithmetic(plan, dp_world_size=3)


# --- the learning rate -----------------------------------------------------------------------


def _optimizer():
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    return torch.optim.SGD([{"params": [params[0]], "lr": 0.1},
                            {"params": [params[1]], "lr": 0.02}])


def _scheduler(spec, optimizer):
    if spec["kind"] == "constant":
        return optimizer
    if spec["kind"] == "lambda":
        decay = spec["decay"]
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: decay ** (e + 1))
    if spec["kind"] == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, spec["step_size"], spec["gamma"])
    from deepshard.runtime.lr_schedules import WarmupLR

    return WarmupLR(optimizer, warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=8)


def _lrs(optimizer):
    return [g["lr"] for g in optimizer.param_groups]


@pytest.mark.parametrize("name", sorted(RECORDED["lr"]))
def test_learning_rates_equal_deepspeed(name):
    record = RECORDED["lr"][name]
    optimizer = _optimizer()
    scheduler = lr_scheduler_for_variable_batch_size(
        record["base_batch_size"], record["batch_sizes"], None,
        _scheduler(record["scheduler"], optimizer), lr_scaling_method=record["method"])
    got = [_lrs(optimizer)]
    for epoch in record["steps"]:
        optimizer.step()
        scheduler.step(epoch)
        got.append(_lrs(optimizer))
    assert got == [pytest.approx(lrs, rel=1e-15) for lrs in record["lrs"]]
    assert scheduler.get_last_lr() == _lrs(optimizer)


def test_scale_lr():
    assert scale_lr(4, 8, 0.1) == pytest.approx(0.2)
    assert scale_lr(4, 16, 0.1, "SQRT") == pytest.approx(0.2)
    assert scale_lr(4, 16, 0.1, None) == scale_lr(4, 16, 0.1, "None") == 0.1
    with pytest.raises(ValueError, match="unknown learning-rate scaling method 'cubic'"):
        scale_lr(4, 8, 0.1, "cubic")


@pytest.mark.parametrize("kind", ["constant", "lambda", "step", "warmup"])
def test_state_round_trip_resumes_exactly(kind):
    sizes = [5, 3, 8, 2, 6, 4, 7]

    def build():
        optimizer = _optimizer()
        return optimizer, lr_scheduler_for_variable_batch_size(
            4, sizes, None, _scheduler({"kind": kind, "decay": 0.8, "step_size": 2,
                                        "gamma": 0.5}, optimizer), "sqrt")

    optimizer, scheduler = build()
    for _ in range(9):
        optimizer.step()
        scheduler.step()
    buffer = io.BytesIO()
    torch.save(scheduler.state_dict(), buffer)
    resumed_optimizer, resumed = build()
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer, weights_only=False))
    assert _lrs(resumed_optimizer) == _lrs(optimizer)
    assert resumed.last_epoch == scheduler.last_epoch == 9
    for _ in range(6):
        for opt, sched in ((optimizer, scheduler), (resumed_optimizer, resumed)):
            opt.step()
            sched.step()
        assert _lrs(resumed_optimizer) == _lrs(optimizer)
        assert resumed.get_unscaled_lr() == scheduler.get_unscaled_lr()


def test_deepspeed_shaped_state_loads_and_other_sizes_warn(caplog):
    optimizer = _optimizer()
    step = torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)
    scheduler = VariableBatchSizeLR(step, 4, [4, 8], None, "linear")
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    state = scheduler.state_dict()
    del state["unscaled_lrs"]  # what DeepSpeed's state lacks
    state["batch_sizes"] = [1, 1]
    other_optimizer = _optimizer()
    other = VariableBatchSizeLR(torch.optim.lr_scheduler.StepLR(other_optimizer, 2, 0.5), 4,
                                [4, 8], None, "linear")
    with caplog.at_level(logging.WARNING):
        other.load_state_dict(copy.deepcopy(state))
    assert "another batch_sizes" in caplog.text
    assert _lrs(other_optimizer) == _lrs(optimizer)


def test_state_of_the_wrapped_scheduler_alone_loads(caplog):
    optimizer = _optimizer()
    plain = torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)
    for _ in range(5):
        optimizer.step()
        plain.step()
    other_optimizer = _optimizer()
    step = torch.optim.lr_scheduler.StepLR(other_optimizer, 2, 0.5)
    scheduler = VariableBatchSizeLR(step, 4, [4, 8], None, "linear")
    scheduler.load_state_dict(plain.state_dict())
    assert scheduler.last_epoch == 5 and scheduler.batch_size == 8
    assert _lrs(other_optimizer) == pytest.approx([2 * lr for lr in _lrs(optimizer)])
    with caplog.at_level(logging.WARNING):
        VariableBatchSizeLR(plain, 4, [4], None)
    assert "at step 5, is reset to step 0" in caplog.text


def test_scheduler_reports_scaled_and_unscaled_and_refuses_plateau():
    optimizer = _optimizer()
    scheduler = VariableBatchSizeLR(torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5), 2,
                                    [4, 1], None, "linear")
    assert scheduler.get_last_lr() == pytest.approx([0.2, 0.04])
    assert scheduler.get_unscaled_lr() == pytest.approx([0.1, 0.02])
    optimizer.step()
    scheduler.step()
    assert scheduler.get_last_lr() == pytest.approx([0.025, 0.005]) and scheduler.batch_size == 1
    scheduler.step(0)
    assert scheduler.get_last_lr() == pytest.approx([0.2, 0.04])
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(_optimizer())
    with pytest.raises(UsageError, match="ReduceLROnPlateau"):
        VariableBatchSizeLR(plateau, 2, [4], None)
    with pytest.raises(ValueError, match="lr_scheduler_or_optimizer"):
        lr_scheduler_for_variable_batch_size(2, [4], None, object())


# --- the loaders -----------------------------------------------------------------------------


def test_loaders_equal_deepspeed():
    record = RECORDED["loader"]
    ids, _, max_seqlens = batch_by_seqlens(**record["args"])
    count = len(record["args"]["seqlens"])
    for rank in range(record["num_replicas"]):
        loader, kwargs = dataloader_for_variable_batch_size(
            list(range(count)), ids, max_seqlens, dataloader_rank=rank,
            dataloader_batch_size=record["batch_size"],
            dataloader_num_replicas=record["num_replicas"], dataloader_num_workers=0)
        assert [list(item) for item in loader] == record["plain"][rank]
        assert sorted(kwargs) == sorted(RECORDED["entry"]["ranks"][0]["io_kwargs"])
        padded, _ = dataloader_for_variable_batch_size(
            [(i,) for i in range(count)], ids, max_seqlens, dataloader_rank=rank,
            dataloader_batch_size=record["batch_size"],
            dataloader_num_replicas=record["num_replicas"], dataloader_num_workers=0,
            required_microbatches_of_same_seqlen=True,
            sample_padding_fn=lambda sample, size: [sample[0], size])
        assert [list(item) for item in padded] == record["padded"][rank]


def test_two_ranks_cover_every_batch_exactly_once():
    seqlens = [(i * 7) % 23 + 1 for i in range(300)]
    train_batch, micro, ranks = 8, 2, 2
    accumulation = train_batch // (micro * ranks)
    plan = plan_batches(seqlens, 40, effective_batch_size=train_batch)
    seen: dict[int, list[int]] = {}
    for rank in range(ranks):
        loader, _ = dataloader_for_variable_batch_size(
            list(range(len(seqlens))), plan.microbatch_ids(), plan.batch_max_seqlens,
            dataloader_rank=rank, dataloader_batch_size=micro, dataloader_num_replicas=ranks,
            dataloader_num_workers=0)
        items = list(loader)
        assert len(items) == plan.num_batches * accumulation
        for k, item in enumerate(items):
            seen.setdefault(k // accumulation, []).extend(item)
    assert sorted(seen) == list(range(plan.num_batches))
    for b, samples in seen.items():
        expected = [i for mb in plan.microbatches[b * train_batch:(b + 1) * train_batch]
                    for i in mb]
        assert sorted(samples) == sorted(expected) and len(set(samples)) == len(samples)
        assert len(samples) == plan.batch_sizes[b]
        assert max(seqlens[i] for i in samples) == plan.batch_max_seqlens[b]


def test_loader_checks():
    ids, _, max_seqlens = batch_by_seqlens([3] * 40, 9, effective_batch_size=6)
    with pytest.raises(UsageError, match="do not share out"):
        dataloader_for_variable_batch_size(list(range(40)), ids, max_seqlens,
                                           dataloader_batch_size=2, dataloader_num_replicas=2)
    with pytest.raises(UsageError, match="sample_padding_fn"):
        dataloader_for_variable_batch_size(list(range(40)), ids, max_seqlens,
                                           required_microbatches_of_same_seqlen=True)
    with pytest.raises(UsageError, match="seed: a random picking order"):
        get_dataloader_and_lr_scheduler_for_variable_batch_size(
            list(range(40)), [3] * 40, 9, 2, sequence_picking_order="random",
            dataloader_num_replicas=2, lr_scheduler_or_optimizer=_optimizer())


# --- the config and the engine ---------------------------------------------------------------


def _engine(section, rank, lr_scheduler=None):
    optimizer = _optimizer()
    return types.SimpleNamespace(
        data_efficiency_config=lambda: section, train_batch_size=lambda: 8,
        train_micro_batch_size_per_gpu=lambda: 2, dp_rank=rank, dp_world_size=2,
        lr_scheduler=lr_scheduler, optimizer=optimizer)


def test_engine_entry_equals_deepspeed():
    record = RECORDED["entry"]
    for rank, expected in enumerate(record["ranks"]):
        engine = _engine(record["data_efficiency"], rank)
        loader, scheduler, kwargs = \
            get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
                list(range(len(record["seqlens"]))), engine, dataset_seqlens=record["seqlens"])
        assert engine.lr_scheduler is scheduler
        assert [list(item) for item in loader] == expected["items"]
        assert scheduler.batch_sizes == expected["batch_sizes"]
        got = [_lrs(engine.optimizer)]
        for _ in range(len(expected["lrs"]) - 1):
            engine.optimizer.step()
            scheduler.step()
            got.append(_lrs(engine.optimizer))
        assert got == [pytest.approx(lrs, rel=1e-15) for lrs in expected["lrs"]]
        assert sorted(kwargs) == expected["io_kwargs"]


def test_engine_entry_called_again_does_not_scale_twice():
    record = RECORDED["entry"]
    engine = _engine(record["data_efficiency"], 0)
    dataset = list(range(len(record["seqlens"])))
    first = get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        dataset, engine, dataset_seqlens=record["seqlens"])[1]
    engine.optimizer.step()
    first.step()
    _, second, _ = get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        dataset, engine, dataset_seqlens=record["seqlens"], dataset_filter_ids=dataset[::2])
    assert second.base_lr_scheduler is first.base_lr_scheduler
    assert second.get_unscaled_lr() == [0.1, 0.02]
    assert second.get_last_lr() == pytest.approx(
        [scale_lr(8, second.batch_sizes[0], lr, "sqrt") for lr in (0.1, 0.02)])


def test_engine_entry_can_leave_the_engine_scheduler():
    record = RECORDED["entry"]
    engine = _engine(record["data_efficiency"], 0)
    get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        list(range(len(record["seqlens"]))), engine, dataset_seqlens=record["seqlens"],
        replace_lr_scheduler=False)
    assert engine.lr_scheduler is None


def _section(**batching):
    return {"data_sampling": {"dynamic_batching": {"enabled": True, "max_tokens": 40}
                              | batching}}


@pytest.mark.parametrize(("batching", "where", "text"), [
    ({"enabled": False}, "enabled", "not enabled"),
    ({"max_tokens": 0}, "max_tokens", "at least 1"),
    ({"min_batch_size": -1}, "min_batch_size", "at least 0"),
    ({"min_batch_size": 3, "max_batch_size": 2}, "max_batch_size", "at least 3"),
    ({"lr_scaling_method": "cubic"}, "lr_scaling_method", "unknown"),
    ({"sequence_picking_order": "shortest"}, "sequence_picking_order", "unknown"),
    ({"verbose": "yes"}, "verbose", "true or false"),
    ({"metrics_path": 3}, "metrics_path", "path"),
])
def test_settings_errors_name_the_key(batching, where, text):
    with pytest.raises(UsageError, match=text) as error:
        dynamic_batching_settings(_section(**batching))
    assert error.value.where == f"{KEY}.{where}"


def test_settings_defaults_and_renamed_budget():
    settings = dynamic_batching_settings(_section() | {"seed": 7})
    assert (settings.max_tokens, settings.lr_scaling_method, settings.min_batch_size,
            settings.max_batch_size, settings.sequence_picking_order, settings.seed,
            settings.num_workers) == (40, "linear", 1, None, "dataloader", 7, 0)
    section = {"data_sampling": {"dynamic_batching": {"enabled": True,
                                                      "max_tokens_per_batch": 40}}}
    with pytest.raises(UsageError, match='rename "max_tokens_per_batch"'):
        dynamic_batching_settings(section)


def test_too_small_a_dataset_names_the_budget_key():
    with pytest.raises(UsageError, match="fewer than the 8 of one batch") as error:
        build_variable_batch_size(list(range(20)), _section(max_tokens=100), train_batch_size=8,
                                  micro_batch_size=1, dp_rank=0, dp_world_size=1,
                                  lr_scheduler_or_optimizer=_optimizer(),
                                  dataset_seqlens=[10] * 20)
    assert error.value.where == f"{KEY}.max_tokens"


def test_lengths_from_the_analyzer_metric(tmp_path):
    dataset = [[0] * n for n in (3, 5, 2, 7, 4, 6, 1, 2, 3, 9)]
    calls = []

    def run_analyzer(*, dataset, metric_fn, collate_fn, save_path):
        calls.append(save_path)
        folder = Path(save_path) / "seqlen"
        folder.mkdir(parents=True)
        for ext in (".idx", ".bin"):
            (folder / f"seqlen_sample_to_metric{ext}").write_bytes(b"")

    def open_index(prefix):
        assert prefix == str(tmp_path / "seqlen" / "seqlen_sample_to_metric")
        return [torch.tensor([len(s)]).numpy() for s in dataset]

    section = _section(metrics_path=str(tmp_path), max_tokens=12)
    built = build_variable_batch_size(
        dataset, section, train_batch_size=2, micro_batch_size=1, dp_rank=0, dp_world_size=1,
        lr_scheduler_or_optimizer=_optimizer(), batch_seqlens_fn=len, open_index=open_index,
        run_analyzer=run_analyzer)
    assert calls == [str(tmp_path)]
    assert built.plan == plan_batches([len(s) for s in dataset], 12, effective_batch_size=2)
    assert load_dataset_seqlens(dataset, tmp_path, open_index=open_index) == [
        len(s) for s in dataset]
    with pytest.raises(UsageError, match="holds 10 lengths for 9 samples"):
        load_dataset_seqlens(dataset[:9], tmp_path, open_index=open_index)
    with pytest.raises(UsageError, match="batch_seqlens_fn") as error:
        load_dataset_seqlens(dataset, tmp_path / "none")
    assert error.value.where == f"{KEY}.metrics_path"

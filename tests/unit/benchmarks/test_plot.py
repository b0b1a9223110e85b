"""benchmarks/plot.py draws the README's PNGs from the benchmarks' JSON records: records
built here by the benchmark scripts' own row writers (a schema round trip, nothing timed),
and the checked-in ``benchmarks/results``; a malformed record is one line and exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytest.importorskip("matplotlib")

sys.path.insert(0, str(ROOT / "benchmarks"))
import data_efficiency
import elastic
import fanout
import inference_report
import launch
import long_seq
import moe
import parallel
import plot
import record
import zero
import zero_compile
import zeropp
from train import Outcome

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
HEIGHTS = {"zero": 660, "fanout": 420, "bubble": 620, "launch": 340, "elastic": 440,
           "moe": 740, "long_seq": 640, "data_efficiency": 460, "zero_compile": 740,
           "inference": 800, "zeropp": 640}
"""Each plot's expected size in pixels: 800 wide, this high."""


def _zero_outcome(name: str, median: float, rss: tuple[int, int],
                  peers: dict = zero.PEERS) -> Outcome:
    ranks = tuple({"peer": name, "rank": r, "step_s": [median * 0.99, median, median * 1.02],
                   "warmup_s": [median * 20, median * 1.1, median], "params": 27369472,
                   "peak_rss_kib": rss[r] * 1024, "optimizer": "AdamW",
                   "losses": [9.1, 9.0], "torch": "2.13", "backend": "gloo"} for r in (0, 1))
    return Outcome(peers[name], ranks)


def zero_record() -> dict:
    outcomes = [_zero_outcome(name, 2.5 + i / 10, (900 - 10 * i, 905 - 10 * i))
                for i, name in enumerate(["compute-floor", "ddp", "ddp-fused", "fsdp2",
                                          "deepspeed-z2", "deepshard-z2", "deepshard-z3"])]
    outcomes.append(Outcome(zero.PEERS["deepspeed-z3"], why_not="failed: it broke"))
    outcomes.append(_zero_outcome("deepshard-z2-torchbwd", 2.9, (800, 801)))
    return record.Run("zero", {"world": 2, "threads_per_rank": 1, "rounds": 2, "steps": 3}) \
        .to_dict(zero.rows(outcomes), zero.table(outcomes))


def zero_compile_outcomes() -> list[Outcome]:
    """Every --compile peer at stages 0-2 ran (compiled 1.4x faster than eager, deepshard
    1.1x faster than DeepSpeed, compiled RSS 10 MiB above eager); stage 3's deepshard
    compiled failed."""
    outcomes = []
    for name, peer in zero.COMPILE_PEERS.items():
        median = {"ddp": 2.2, "deepspeed": 2.0, "deepshard": 2.0 / 1.1}[peer.runtime]
        median /= 1.4 if peer.compiled else 1.0
        rss = 900 + 10 * peer.compiled
        outcomes.append(Outcome(peer, why_not="failed: it broke")
                        if name == "deepshard-z3-compiled" else
                        _zero_outcome(name, median, (rss, rss - 5), zero.COMPILE_PEERS))
    return outcomes


def zero_compile_record() -> dict:
    outcomes = zero_compile_outcomes()
    firsts = {o.peer.name: [40.0 if o.peer.compiled else 3.0] * 2 for o in outcomes}
    return record.Run("zero_compile", {"world": 2, "threads_per_rank": 1, "rounds": 2,
                                       "steps": 3}).to_dict(
        zero_compile.rows(outcomes, firsts), zero_compile.table(outcomes, firsts))


def _bubble_outcome(m: int) -> parallel.Outcome:
    spec = parallel.RunSpec(f"pp2-m{m}", 2, 2, 1, 2, m, "balanced", 2, 0, "uniform")
    theory = 1 / (m + 1)
    timing = [{"total_s": 1.0, "pipe_s": 0.95, "busy_s": 0.95 * (1 - theory),
               "forward_s": 0.3, "backward_s": 0.6}] * 2
    ranks = tuple({"rank": r, "coord": [r, 0, 0], "parts": [0, 4, 8], "step_s": [1.0, 1.1],
                   "losses": [5.5, 5.4], "timing": timing} for r in (0, 1))
    return parallel.Outcome(spec, ranks)


def parallel_record() -> dict:
    outcomes = [_bubble_outcome(m) for m in (2, 4, 8)]
    return record.Run("parallel", {"bubble_size": "balanced", "steps": 2}).to_dict(
        parallel.bubble_rows(outcomes), parallel.bubble_table(outcomes))


def fanout_record() -> dict:
    def walls(n: int) -> dict[str, list[float]]:
        return {m: [0.5 + n / (10 + i), 0.6 + n / (10 + i)] for i, m in enumerate(fanout.MODES)}

    rows = [fanout.row(n, walls(n), {m: [t / 3 for t in v] for m, v in walls(n).items()})
            for n in (8, 32, 64, 128)]
    model = fanout.fit(rows)
    projected = [fanout.project(model, n) for n in fanout.PROJECT]
    run = record.Run("fanout", {"rounds": 2, "hosts": [8, 32, 64, 128], "cpu_model": model,
                                "projected": projected})
    return run.to_dict(rows, fanout.table(rows, projected))


def launch_record() -> dict:
    runs = launch.launchers()
    times = {name: [0.1 * (i + 1) ** 2, 0.11 * (i + 1) ** 2] for i, name in enumerate(runs)}
    rows = launch.rows(runs, times)
    return record.Run("launch", {"rounds": 2}).to_dict(rows, launch.table(rows))


def elastic_record() -> dict:
    rows = [{"hosts": n, "launcher": name, "status": "ok", "shrink_s": 9.0 + n + i,
             "grow_s": 7.0 + n + 2 * i, "relaunch_shrink_s": 2.0 + i, "relaunch_grow_s": 1.0,
             "load_shrink_s": 0.15, "load_grow_s": 0.16, "steps_redone_shrink": 0,
             "steps_redone_grow": 0} for n in (3, 8) for i, name in enumerate(elastic.JOBS)]
    rows.append({"hosts": 8, "launcher": "torchrun", "status": "failed: no step"})
    return record.Run("elastic", {"monitor_timeout": 10.0}).to_dict(rows,
                                                                   elastic.table(rows, 10.0))


def _moe_ranks(s: float, sent: int | None) -> list[dict]:
    steps = [{"s": s * 1.5, "loss": 6.38, "routed": 2048, "sent_rows": sent}] + [
        {"s": s, "loss": 6.40, "routed": 2048, "sent_rows": sent}] * 2
    return [{"steps": steps, "timed_from": 1, "a2a_bytes": 8_000_000, "a2a_calls": 20,
             "peak_rss_kib": (500 + 10 * r) * 1024, "tokens_per_step": 2048, "moe_layers": 2,
             "threads": 1} for r in range(4)]


def moe_record() -> dict:
    rows = [{"impl": impl, "ep": ep, **moe.summarize(_moe_ranks(s, sent))}
            for ep in (2, 4)
            for impl, s, sent in (("deepshard", 1.5, 900), ("DeepSpeed", 2.0, None))]
    moe.add_ratios(rows)
    return record.Run("moe", {"world": 4, "threads_per_rank": 1, "zero_stage": 2,
                              "steps": 2}).to_dict(rows, moe.table(rows))


def long_seq_record() -> dict:
    raw = [{"sp": sp, "tiled": tiled, "status": "ok",
            "max_length": 192 * sp * (4 if tiled else 1), "capped": tiled,
            "peak_rss_mib": 510.0, "probes": [[64, 457.0, True]],
            "deepshard": {"step_s": [1.0, 1.1], "group_peak_rss_mib": 500.0} if sp > 1 else None,
            "deepspeed": {"step_s": [1.2, 1.3], "group_peak_rss_mib": 520.0} if sp > 1 else None}
           for sp in (1, 2, 4) for tiled in (False, True)]
    rows = long_seq.summarize(raw)
    return record.Run("long_seq", {"budget_mib": 528.0, "steps": 2}).to_dict(
        rows, long_seq.table(rows, 528.0))


def data_efficiency_record() -> dict:
    def curve(speed: float, floor: float) -> list[dict]:
        return [{"step": s, "wall_s": s * speed, "tokens": s * 4096, "seq": 256,
                 "val_loss": floor + 3.0 / s} for s in range(20, 420, 20)]
    base = {"variant": "baseline", "status": "ok", "curve": curve(1.0, 1.5)}
    rows = [data_efficiency.summarize(base, base, 400)] + [
        data_efficiency.summarize({"variant": v, "status": "ok", "curve": curve(sp, fl)}, base,
                                  400)
        for v, sp, fl in (("curriculum", 0.8, 1.5), ("ltd", 0.85, 1.52), ("both", 0.7, 1.5))]
    return record.Run("data_efficiency", {"steps": 400}).to_dict(
        rows, data_efficiency.table(rows))


def inference_record() -> dict:
    def row(arch: str, peer: str, tp: int, dtype: str, batch: int, tokens_per_s: float,
            rss: float) -> dict:
        return {"arch": arch, "peer": peer, "runtime": peer, "tp": tp, "dtype": dtype,
                "batch": batch, "tokens": 128, "status": "ok", "first_token_ms": 40.0,
                "tokens_per_s": tokens_per_s * batch, "wall_s": [1.0], "first_token_s": [0.04],
                "peak_rss_mib": [rss + 10 * r for r in range(tp)],
                "import_rss_mib": [370.0] * tp,
                "work_rss_mib": [rss + 10 * r - 370.0 for r in range(tp)],
                "tokens_equal_hf": True, "first_difference": None,
                "ranks_agree": True, "agreement": 1.0 if dtype == "fp32" else 0.97,
                "perplexity": 48000.0 if dtype == "fp32" else 48300.0, "streamed": 129,
                "load_s": 2.0, "threads_per_rank": 2 // tp, "layers": {}}
    rows = [r for arch in ("gpt2", "llama") for b in (1, 8) for r in (
        row(arch, "hf", 1, "fp32", b, 20, 900), row(arch, "deepspeed", 1, "fp32", b, 21, 950),
        row(arch, "deepshard", 1, "fp32", b, 22, 700),
        row(arch, "deepshard", 2, "fp32", b, 30, 420),
        row(arch, "deepshard", 2, "int8", b, 40, 300))]
    rows.append(row("llama", "deepspeed", 2, "fp32", 1, 18, 600))
    rows += [{"arch": arch, "peer": "deepspeed", "runtime": "deepspeed", "tp": tp,
              "dtype": "int8", "batch": 1, "status": "not runnable: ValueError: Data type "
              "torch.int8 is not supported by cpu accelerator"}
             for arch in ("gpt2", "llama") for tp in (1, 2)]
    rows.append({"arch": "gpt2", "peer": "deepspeed", "runtime": "deepspeed", "tp": 2,
                 "dtype": "fp32", "batch": 1,
                 "status": "not runnable: AssertionError: AutoTP not supported"})
    rows = inference_report.add_ratios(rows)
    models = {"gpt2": {"title": "GPT-2 12 layers x 768"},
              "llama": {"title": "LLaMA 12 layers x 768 (MLP 2048)"}}
    return record.Run("inference", {"models": models, "prompt_len": 32, "tokens": 128,
                                     "cores": 2}).to_dict(rows, inference_report.table(rows))


def test_the_inference_plot_lists_what_did_not_run_once_per_status_over_the_archs():
    lines = plot.inference_missing(inference_record()["rows"])
    assert lines == [
        "gpt2/llama deepspeed tp 1 int8: not runnable: ValueError: Data type torch.int8 is "
        "not supported by cpu accelerator",
        "gpt2/llama deepspeed tp 2 int8: not runnable: ValueError: Data type torch.int8 is "
        "not supported by cpu accelerator",
        "gpt2 deepspeed tp 2 fp32: not runnable: AssertionError: AutoTP not supported"]


def zeropp_record() -> dict:
    rows = []
    for rate, slow in (("1gbit", 1.0), ("200mbit", 4.0)):
        for runtime, variants in (("deepshard", zeropp.VARIANTS), ("deepspeed", zeropp.DEEPSPEED)):
            for k, variant in enumerate(variants):
                rows.append({"rate": rate, "runtime": runtime, "variant": variant,
                             "status": "ok", "step_s": 4.0 + slow * (5 - k),
                             "times_s": [4.0], "loss": 5.8,
                             "cross_host_bytes": 6.5e8 / (k + 1)})
    rows.append({"rate": "200mbit", "runtime": "deepspeed", "variant": "MiCS",
                 "status": "failed: removed in 0.19"})
    return record.Run("zeropp", {"steps": 2}).to_dict(rows, zeropp.table(rows))


@pytest.fixture
def results(tmp_path):
    """A results folder with one record per benchmark, as the scripts write them."""
    folder = tmp_path / "results"
    folder.mkdir()
    for data in (zero_record(), parallel_record(), fanout_record(), launch_record(),
                 elastic_record(), moe_record(), long_seq_record(),
                 data_efficiency_record(), zero_compile_record(), inference_record(),
                 zeropp_record()):
        (folder / f"{data['benchmark']}.json").write_text(json.dumps(data))
    return folder


def assert_pngs(out, names=tuple(plot.PLOTS)) -> None:
    from matplotlib.image import imread

    for name in names:
        path = out / f"{name}.png"
        assert path.read_bytes()[:8] == PNG_SIGNATURE, name
        assert imread(path).shape[:2] == (HEIGHTS[name], 800), name
        assert path.stat().st_size < 150_000, name


def test_records_the_scripts_write_read_back_in_the_schema(results):
    for name, benchmark in plot.PLOTS.items():
        data = record.read(results / f"{benchmark}.json", benchmark)
        assert data["schema"] == record.SCHEMA and data["rows"] and data["table"], name
        assert data["commit"] and data["date"].endswith("Z")


def test_plots_drawn_from_the_records_are_pngs_of_readme_width(results, tmp_path):
    out = tmp_path / "plots"
    assert plot.main(["--results", str(results), "--out", str(out)]) == 0
    assert_pngs(out)


def test_the_checked_in_results_plot(tmp_path):
    present = [name for name, b in plot.PLOTS.items()
               if (record.RESULTS / f"{b}.json").exists()]
    if not present:
        pytest.skip("no checked-in benchmarks/results yet")
    assert plot.main(["--out", str(tmp_path), "--only", ",".join(present)]) == 0
    assert_pngs(tmp_path, present)


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ("[]", "expected a JSON object"),
    ('{"schema": 1}', "missing key 'benchmark'"),
])
def test_a_malformed_record_is_one_line_and_exit_2(results, tmp_path, capsys, content,
                                                   message):
    (results / "launch.json").write_text(content)
    assert plot.main(["--results", str(results), "--out", str(tmp_path),
                      "--only", "launch"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(results / "launch.json") in err and message in err


def test_a_record_missing_a_field_names_the_file(results, tmp_path, capsys):
    data = json.loads((results / "fanout.json").read_text())
    del data["rows"][0]["pdsh_s"]
    (results / "fanout.json").write_text(json.dumps(data))
    assert plot.main(["--results", str(results), "--out", str(tmp_path),
                      "--only", "fanout"]) == 2
    assert capsys.readouterr().err == f"plot.py: {results / 'fanout.json'}: " \
        "missing field 'pdsh_s'\n"


def test_the_command_line_reports_a_missing_record_without_a_traceback(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plot.py"),
                             "--results", str(tmp_path), "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == f"plot.py: {tmp_path / 'zero.json'}: no such file " \
        "(run the benchmark first)\n"


def test_the_quietest_round_is_the_lowest_median_of_a_rounds_steps():
    row = {"step_s": [1.0, 3.0, 2.0, 5.0, 4.0, 6.0, 0.9, 1.1]}
    assert plot.quietest_round(row, 3) == 1.0  # rounds [1 3 2] [5 4 6] [0.9 1.1]


def test_data_efficiency_time_to_target_interpolates_and_reads_the_verdict():
    base = {"variant": "baseline", "status": "ok", "curve": [
        {"step": 10, "wall_s": 10.0, "tokens": 100, "val_loss": 3.0},
        {"step": 20, "wall_s": 20.0, "tokens": 200, "val_loss": 2.0}]}
    fast = {"variant": "both", "status": "ok", "curve": [
        {"step": 10, "wall_s": 5.0, "tokens": 50, "val_loss": 2.5},
        {"step": 20, "wall_s": 10.0, "tokens": 100, "val_loss": 1.5}]}
    row = data_efficiency.summarize(fast, base, 20)
    assert row["wall_to_target_s"] == pytest.approx(7.5)  # halfway between 2.5 and 1.5
    assert row["speedup"] == pytest.approx(20 / 7.5)
    assert row["val_at_steps"] == 1.5 and row["val_at_base_wall"] is None
    rows = [data_efficiency.summarize(base, base, 20), row]
    assert all("MET" in line and "NOT" not in line
               for line in data_efficiency.verdicts(rows)[:1])


def test_zero_compile_targets_compare_compiled_with_eager_and_deepspeed_per_stage():
    outcomes = zero_compile_outcomes()
    x_eager, x_ds = zero_compile.speedups(outcomes)["deepshard-z2-compiled"]
    assert x_eager == pytest.approx(1.4) and x_ds == pytest.approx(1.1)
    assert zero_compile.speedups(outcomes)["ddp-compiled"][0] == pytest.approx(1.4)
    lines = zero_compile.targets(outcomes)
    assert lines[:2] == [
        "target stage 0: deepshard compiled >= 1.25x faster than deepshard eager: 1.40x, met",
        "target stage 0: deepshard compiled peak RSS <= deepshard eager's: 910 MiB vs "
        "900 MiB, MISSED"]
    assert "target stage 2: deepshard compiled >= 1.2x faster than DeepSpeed compiled: "\
        "1.10x, MISSED" in lines
    assert sum("not measured (deepshard-z3-compiled did not run)" in line
               for line in lines) == 3

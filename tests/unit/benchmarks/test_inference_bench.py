"""benchmarks/inference.py's pure parts (the archs, the plan, the carried failures, the rows
read back from the ranks' result files), inference_worker.py's and inference_report.py's
ratios and target verdicts, on made-up rows; nothing is launched or timed here."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import inference as bench
import inference_report as report
import inference_worker as worker


def row(peer: str, tp: int, dtype: str, batch: int, tokens_per_s: float, rss: float,
        perplexity: float = 100.0, arch: str = "gpt2", imports: float = 370.0,
        **extra) -> dict:
    runtime = peer.split("-")[0]
    return {"arch": arch, "peer": peer, "runtime": runtime, "tp": tp, "dtype": dtype,
            "batch": batch, "tokens": 128, "status": "ok", "first_token_ms": 50.0,
            "tokens_per_s": tokens_per_s, "wall_s": [1.0, 1.1], "peak_rss_mib": [rss] * tp,
            "import_rss_mib": [imports] * tp, "work_rss_mib": [rss - imports] * tp,
            "tokens_equal_hf": True, "first_difference": None, "ranks_agree": True,
            "agreement": 1.0, "perplexity": perplexity, "streamed": 129, "load_s": 1.0,
            "threads_per_rank": 2 // tp, **extra}


def not_run(peer: str, tp: int, dtype: str, batch: int, status: str,
            arch: str = "gpt2") -> dict:
    return {"arch": arch, "peer": peer, "runtime": peer.split("-")[0], "tp": tp,
            "dtype": dtype, "batch": batch, "status": status}


# ---------------------------------------------------------------- archs and the plan

def test_the_gpt2_directory_keeps_its_name_and_llama_gets_its_own():
    args = bench.parse_args([])[0]
    gpt2, llama = (bench.make_setup(a, args) for a in ("gpt2", "llama"))
    assert gpt2.model_name == "gpt2-12x768h12-v50257-seed1234"  # the cached model is reused
    assert llama.model_name == "llama-12x768h12kv12i2048-v32000-seed1234"
    assert llama.model == {"hidden_size": 768, "intermediate_size": 2048,
                           "num_hidden_layers": 12, "num_attention_heads": 12,
                           "num_key_value_heads": 12, "vocab_size": 32000,
                           "max_position_embeddings": 512, "tie_word_embeddings": False}
    assert llama.title == "LLaMA 12 layers x 768 (MLP 2048)"
    quick = bench.make_setup("llama", bench.parse_args(["--quick"])[0])
    assert (quick.model["num_hidden_layers"], quick.tokens, quick.repeats) == (2, 8, 1)
    assert quick.model_name != llama.model_name


def test_each_archs_module_names_are_its_models():
    """The strings the ranks resolve (reported layers, the policy's block and projections)
    name real modules of a model built from the arch's quick config."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for arch in worker.ARCHS.values():
        with torch.device("meta"):
            model = getattr(transformers, arch.model_class)(
                getattr(transformers, arch.config)(**arch.quick))
        named = dict(model.named_modules())
        assert all(name in named for name in arch.layers), arch.name
        block = named[arch.block0]
        assert type(block) is worker.block_class(arch.name)
        assert all(p in dict(block.named_modules()) for p in arch.row_parallel)
        types = worker.layer_types(model, arch.layers)
        assert types[arch.layers[-1]].startswith("Linear["), arch.name


def test_the_plan_is_every_setup_of_every_peer_at_every_batch():
    specs = bench.plan("llama", ["hf", "deepshard"], (1, 8))
    assert specs[:3] == [bench.RunSpec("llama", "hf", 1, "fp32", 1),
                         bench.RunSpec("llama", "hf", 1, "fp32", 8),
                         bench.RunSpec("llama", "deepshard", 1, "fp32", 1)]
    assert len(specs) == 2 + 4 * 2
    assert {(s.tp, s.dtype) for s in specs if s.peer == "deepshard"} == {
        (1, "fp32"), (2, "fp32"), (1, "int8"), (2, "int8")}


@pytest.mark.parametrize("cores, tp, want", [(2, 1, 2), (2, 2, 1), (2, 4, 1), (16, 2, 8)])
def test_the_ranks_of_a_launch_share_the_cores(cores, tp, want):
    assert bench.threads(cores, tp) == want


@pytest.mark.parametrize("ours, want", [
    ([[1, 2, 3], [4, 5, 6]], None),
    ([[1, 2, 3], [4, 9, 6]], 1),
    ([[1, 2], [4, 5, 6]], 2),  # one sequence came back short
    ([[1, 2, 9], [4, 9, 6]], 1),  # the earliest over the batch
])
def test_the_first_difference_is_the_first_position_any_sequence_differs(ours, want):
    assert worker.first_difference(ours, [[1, 2, 3], [4, 5, 6]]) == want


def test_a_refusal_at_init_repeats_at_every_batch_and_a_failure_is_not_retried():
    failed = {("gpt2", "deepspeed", 2, "fp32"): (1, "not runnable: AssertionError: AutoTP"),
              ("gpt2", "deepshard", 1, "int8"): (1, "failed: TypeError: boom")}
    assert bench.carried_status(bench.RunSpec("gpt2", "deepspeed", 2, "fp32", 8), failed) \
        == "not runnable: AssertionError: AutoTP"
    assert bench.carried_status(bench.RunSpec("gpt2", "deepshard", 1, "int8", 8), failed) \
        == "skipped: it failed at batch 1: failed: TypeError: boom"
    assert bench.carried_status(bench.RunSpec("gpt2", "deepshard", 2, "int8", 8), failed) \
        is None
    # the same peer on the other arch is its own configuration
    assert bench.carried_status(bench.RunSpec("llama", "deepspeed", 2, "fp32", 8), failed) \
        is None


# ---------------------------------------------------------------- a rank's numbers

def test_the_rss_now_is_vmrss_in_kib(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmPeak:\t  900000 kB\nVmRSS:\t  378880 kB\n")
    assert worker.rss_now_kib(status) == 378880
    assert worker.rss_now_kib(tmp_path / "absent") == worker.peak_rss_kib()


def rank_result(rank: int, first_difference=None, **extra) -> dict:
    return {"rank": rank, "status": "ok", "first_token_s": [0.05, 0.07], "wall_s": [2.0, 4.0],
            "peak_rss_kib": (500 + rank) * 1024, "import_rss_kib": (370 + 2 * rank) * 1024,
            "first_difference": first_difference, "agreement": 1.0, "perplexity": 99.0,
            "scored_tokens": 128, "streamed": 129, "load_s": 1.5, "threads": 1, "layers": {},
            "torch": "2.13", "transformers": "5.23", **extra}


def quick_setup(**kw) -> bench.Setup:
    return bench.Setup(**{"arch": "gpt2", "model": worker.ARCHS["gpt2"].quick, "tokens": 8,
                          "batches": (1,), "repeats": 1, "cores": 2, **kw})


def test_the_row_is_rank_0s_medians_and_every_ranks_rss_and_its_part_above_imports(tmp_path):
    got = bench.collect([rank_result(1, first_difference=3), rank_result(0)], 0,
                        tmp_path / "log", bench.RunSpec("gpt2", "deepshard", 2, "fp32", 8),
                        quick_setup(tokens=128, batches=(8,), repeats=2))
    assert got["status"] == "ok"
    assert got["tokens_per_s"] == pytest.approx(8 * 128 / 3.0)
    assert got["first_token_ms"] == pytest.approx(60.0)
    assert got["peak_rss_mib"] == [500.0, 501.0]
    assert got["import_rss_mib"] == [370.0, 372.0]
    assert got["work_rss_mib"] == [130.0, 129.0]
    assert got["tokens_equal_hf"] and not got["ranks_agree"]


def test_a_rank_that_reported_a_failure_names_it_and_one_that_did_not_report_is_read_from_the_log(
        tmp_path):
    spec, setup = bench.RunSpec("gpt2", "deepshard", 2, "int8", 1), quick_setup()
    bad = {"rank": 1, "status": "failed: TypeError: no kernel"}
    assert bench.collect([rank_result(0), bad], 1, tmp_path / "log", spec, setup)["status"] \
        == "failed: TypeError: no kernel (rank 1)"
    log = tmp_path / "launch.log"
    log.write_text("[localhost:1] Traceback ...\n[localhost:1] RuntimeError: gloo hung up\n"
                   "ds-run: last 2 line(s) of rank 1:\n")
    assert bench.collect([rank_result(0)], 1, log, spec, setup)["status"] \
        == "failed: exit 1, 1 of 2 rank results: RuntimeError: gloo hung up"


# ---------------------------------------------------------------- the report

def rows_for_targets(llama: bool = True) -> list[dict]:
    """GPT-2: DeepSpeed refuses tp 2; LLaMA: it runs (deepshard 1.5x it at batch 1, 1.1x at
    batch 8)."""
    rows = []
    for b in (1, 8):
        rows += [row("hf", 1, "fp32", b, 10.0 * b, 1000.0),
                 row("deepspeed", 1, "fp32", b, 11.0 * b, 1050.0),
                 not_run("deepspeed", 2, "fp32", b, "not runnable: AssertionError: AutoTP"),
                 row("deepshard", 2, "fp32", b, 24.0 * b, 550.0 if b == 1 else 700.0),
                 row("deepshard", 2, "int8", b, 36.0 * b, 400.0, perplexity=101.0)]
    for b in (1, 8) if llama else ():
        rows += [row("hf", 1, "fp32", b, 9.0 * b, 1100.0, arch="llama"),
                 row("deepspeed", 2, "fp32", b, 10.0 * b, 800.0, arch="llama"),
                 row("deepshard", 2, "fp32", b, (15.0 if b == 1 else 11.0) * b, 600.0,
                     arch="llama")]
    return report.add_ratios(rows)


def test_the_ratios_compare_within_an_arch():
    rows = rows_for_targets()
    int8 = next(r for r in rows if r["dtype"] == "int8" and r["batch"] == 1)
    assert int8["speed_vs_fp32"] == pytest.approx(1.5)
    assert int8["perplexity_vs_fp32"] == pytest.approx(1.01)
    assert int8["rss_vs_hf"] == pytest.approx(0.4)
    assert int8["work_vs_hf"] == pytest.approx(30 / 630)
    assert int8["vs_deepspeed"] is None  # DeepSpeed's GPT-2 tp 2 did not run
    ours = next(r for r in rows if r["arch"] == "llama" and r["peer"] == "deepshard"
                and r["batch"] == 1)
    assert ours["vs_deepspeed"] == pytest.approx(1.5)
    assert ours["rss_vs_hf"] == pytest.approx(600 / 1100)


def test_the_targets_say_met_missed_or_not_measured_with_why_per_arch():
    lines = report.targets(rows_for_targets())
    assert lines[0] == (
        "target gpt2 batch 1: deepshard tp 2 tokens/s >= 1.2x DeepSpeed tp 2: not measured "
        "(deepspeed tp 2 fp32 batch 1: not runnable: AssertionError: AutoTP); measured on "
        "llama instead, which DeepSpeed runs at tp 2: 1.50x, met")
    assert lines[1] == "  context gpt2 batch 1: deepshard tp 2 / DeepSpeed tp 1 tokens/s = 2.18x"
    assert lines[2].endswith("550 MiB vs 1000 MiB = 0.55x (above imports: 180 MiB vs 630 MiB "
                             "= 0.29x), met")
    assert lines[3] == "target gpt2 batch 1: deepshard tp 2 int8 tokens/s >= 1.3x fp32: 1.50x, met"
    assert lines[4].endswith("101.00 vs 100.00 (+1.00%), met")
    assert "measured on llama instead, which DeepSpeed runs at tp 2: 1.10x, MISSED" in lines[5]
    assert "700 MiB vs 1000 MiB = 0.70x (above imports: 330 MiB vs 630 MiB = 0.52x), MISSED" \
        in lines[7]
    llama = [line for line in lines if line.startswith("target llama") and "int8" not in line]
    assert llama == [
        "target llama batch 1: deepshard tp 2 tokens/s >= 1.2x DeepSpeed tp 2: 1.50x, met",
        "target llama batch 1: deepshard tp 2 peak RSS per rank <= 0.6x HF generate's (one "
        "process): 600 MiB vs 1100 MiB = 0.55x (above imports: 230 MiB vs 730 MiB = 0.32x), met",
        "target llama batch 8: deepshard tp 2 tokens/s >= 1.2x DeepSpeed tp 2: 1.10x, MISSED",
        "target llama batch 8: deepshard tp 2 peak RSS per rank <= 0.6x HF generate's (one "
        "process): 600 MiB vs 1100 MiB = 0.55x (above imports: 230 MiB vs 730 MiB = 0.32x), met"]
    assert "target llama batch 1: deepshard tp 2 int8 tokens/s >= 1.3x fp32: not measured " \
        "(deepshard tp 2 int8 batch 1: not run)" in lines


def test_without_another_arch_the_refused_target_only_says_why():
    lines = report.targets(rows_for_targets(llama=False))
    assert lines[0].endswith("(deepspeed tp 2 fp32 batch 1: not runnable: AssertionError: "
                             "AutoTP)")


def test_the_import_baseline_line_gives_each_runtimes_range_and_their_spread():
    rows = rows_for_targets()
    rows[1] = {**rows[1], "import_rss_mib": [385.0]}
    assert report.import_baselines(rows) == [
        "Import baseline (RSS per rank right after importing torch, transformers and the "
        "peer's library, before any model): hf 370-370 MiB, deepspeed 370-385 MiB, deepshard "
        "370-370 MiB; the same for every peer within 15 MiB. \"above imports\" = each rank's "
        "peak RSS - its own baseline: the weights and the work."]
    assert report.import_baselines([not_run("hf", 1, "fp32", 1, "failed: x")]) == []


def test_the_table_gives_a_row_that_did_not_run_its_reason_and_a_divergence_its_position():
    rows = rows_for_targets()
    rows[0] = {**rows[0], "tokens_equal_hf": False, "first_difference": 17}
    rows[2] = {**rows[2], "status": "failed: a | b"}
    lines = report.table(rows)
    assert lines[2].startswith("| gpt2 | hf | 1 | fp32 | 1 | 50.0 | 10.0 | 1000 | 630 | "
                               "no (from token 17) |")
    assert lines[4].endswith("| - | - | - | - | - | - | - | failed: a \\| b |")
    assert "| 400 / 400 | 30 / 30 |" in lines[6] and "(1.0100x fp32)" in lines[6]
    assert "0.40x HF's peak RSS (0.05x above imports)" in lines[6]


def test_the_module_types_are_per_arch_without_the_model_prefix():
    rows = [row("deepshard", 2, "fp32", b, 1.0, 1.0, arch=arch,
                layers={f"{prefix}.embed": "Embedding[8x4 float32]", "lm_head": "X[8x2 int8]"})
            for arch, prefix in (("gpt2", "transformer"), ("llama", "model")) for b in (1, 8)]
    assert report.layers(rows) == [
        "- gpt2 deepshard tp 2 fp32: embed Embedding[8x4 float32], lm_head X[8x2 int8]",
        "- llama deepshard tp 2 fp32: embed Embedding[8x4 float32], lm_head X[8x2 int8]"]


# ---------------------------------------------------------------- command line

def test_the_archs_default_to_both_gpt2_first_and_keep_the_order_given():
    assert bench.parse_args([])[1] == ["gpt2", "llama"]
    assert bench.parse_args(["--arch", "llama,gpt2,llama"])[1] == ["llama", "gpt2"]


@pytest.mark.parametrize("argv, message", [
    (["--only", "hf,vllm"], "--only: unknown peer 'vllm'"),
    (["--arch", "t5"], "--arch: unknown arch 't5'; choose from gpt2, llama"),
    (["--arch", ","], "--arch: no arch named"),
])
def test_an_unknown_peer_or_arch_is_a_usage_error(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err

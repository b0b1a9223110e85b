"""deepshard.comm on 2 real gloo ranks (ds-run): every collective agrees with
torch.distributed's on the same tensors, and log_summary's table lists each op with the
number of calls the script made."""

from __future__ import annotations

import re

from deepshard.comm.logger import convert_size
from tests.helpers import ROOT, run_ds, tagged_json

SCRIPT = str(ROOT / "tests" / "dist" / "scripts" / "comm_probe.py")
HEADER = ("Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)",
          "tput_avg (Gbps)", "busbw_avg (Gbps)")


def summary_table(stdout: str, prefix: str = "[localhost:0] ") -> dict[str, dict[str, int]]:
    """The table rank 0 printed: op -> {message size as printed: count}."""
    lines = [line.removeprefix(prefix) for line in stdout.splitlines() if line.startswith(prefix)]
    start = next(i for i, line in enumerate(lines) if line.startswith("Comm. Op"))
    assert re.split(r"\s{2,}", lines[start].strip()) == list(HEADER)
    table: dict[str, dict[str, int]] = {}
    op = None
    for line in lines[start + 1:]:
        if line.startswith("RESULT"):
            break
        if not line.startswith(" "):
            op = line.strip()
            table[op] = {}
            continue
        size, count, *figures = re.split(r"\s{2,}", line.strip())
        assert len(figures) == 4 and all(float(f) >= 0 for f in figures), line
        table[op][size] = int(count)
    return table


def test_collectives_match_torch_and_the_summary_counts_them():
    result = run_ds("--num_gpus", "2", SCRIPT, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    results = {rank: data for rank, (_, data) in tagged_json(result.stdout, "RESULT").items()}
    assert sorted(results) == [0, 1]
    for rank, data in results.items():
        assert data["world"] == 2 and data["source"] == "contract"
        assert data["backend"] == "gloo" and data["local_rank"] == rank and data["initialized"]
        assert data["global_rank_of_1"] == 1 and data["group_ranks"] == [0, 1]
        assert data["same"] and all(data["same"].values()), data["same"]
        assert len(data["same"]) == 19
        # all_reduce: plain, MAX, async, inference_all_reduce (logged as all_reduce), subgroup
        assert data["counts"]["all_reduce"] == {"24": 5, "44": 1}  # 44 B: the coalesced one
        assert data["counts"]["all_gather_into_tensor"] == {"24": 2}  # + allgather_fn
        assert data["counts"]["reduce_scatter_tensor"] == {"24": 2}  # + reduce_scatter_fn
        assert data["counts"]["barrier"] == {"0": 1}  # log_summary's own are not recorded
        assert ("send" in data["counts"]) == (rank == 0)
        assert data["filtered"] == [["my_all_reduce", "broadcast"], 3]
        assert data["debug_names"] == ["all_reduce | [Caller Func: <module>]"]

    table = summary_table(result.stdout)
    assert "[localhost:1] Comm. Op" not in result.stdout  # rank 0 prints it, alone
    expected = {op: {convert_size(int(size)): n for size, n in sizes.items()}
                for op, sizes in results[0]["counts"].items()}
    assert table == expected
    assert table["all_reduce"] == {"24.0 B": 5, "44.0 B": 1}
    for op in ("reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all_single",
               "irecv", "batch_isend_irecv", "monitored_barrier", "all_gather_object"):
        assert sum(table[op].values()) == 1, op


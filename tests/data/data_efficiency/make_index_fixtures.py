"""Regenerates this folder's DeepSpeed-written files with a real DeepSpeed.

Run from a side virtual environment holding DeepSpeed (not deepshard's)::

    DS_ACCELERATOR=cpu /path/to/dsvenv/bin/python tests/data/data_efficiency/make_index_fixtures.py

``index/<case>.{idx,bin}``: each case of ``synthetic.INDEX_CASES`` written by DeepSpeed's
``MMapIndexedDatasetBuilder`` (rows with ``add_item_numpy``, a document boundary after each
entry of the case's document index but the first, then ``finalize``).

``analyzer/``: the final files of DeepSpeed's ``DataAnalyzer`` over ``synthetic.TokenDataset``
with the metrics of ``synthetic.METRIC_*``, mapped by 2 workers (``run_map`` with
``worker_id`` 0 and 1), then ``run_reduce``. The script checks that one worker gives the same
files. ``version.json`` records the versions that wrote them.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import synthetic as syn  # noqa: E402


def write_index_cases(out: Path) -> None:
    from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import (
        MMapIndexedDatasetBuilder,
    )

    out.mkdir(parents=True, exist_ok=True)
    for name, (dtype, rows, doc_idx) in syn.INDEX_CASES.items():
        builder = MMapIndexedDatasetBuilder(str(out / f"{name}.bin"), dtype=dtype)
        for i, row in enumerate(rows):
            builder.add_item_numpy(np.array(row, dtype=dtype))
            if i + 1 in doc_idx[1:]:
                builder.end_document()
        for _ in range(doc_idx[1:].count(0)):
            builder.end_document()  # boundaries before any row (the empty case)
        builder.finalize(str(out / f"{name}.idx"))
        assert builder._doc_idx == doc_idx, (name, builder._doc_idx)


def final_files(save_path: Path) -> list[Path]:
    names = []
    for metric, kind in zip(syn.METRIC_NAMES, syn.METRIC_TYPES, strict=True):
        stems = (["sample_to_metric", "index_to_sample", "index_to_metric",
                  "index_to_sample_percentile_merged"]
                 if kind == "single_value_per_sample" else ["metric_value"])
        names += [Path(metric) / f"{metric}_{stem}.{ext}" for stem in stems
                  for ext in ("idx", "bin")]
    return names


def run_analyzer(save_path: Path, num_workers: int) -> None:
    from deepspeed.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer

    for worker_id in range(num_workers):
        analyzer = DataAnalyzer(
            syn.TokenDataset(), num_workers=num_workers, worker_id=worker_id,
            batch_size=syn.BATCH_SIZE, metric_names=syn.METRIC_NAMES,
            metric_functions=syn.METRIC_FUNCTIONS, metric_types=syn.METRIC_TYPES,
            metric_dtypes=[torch.int64] * len(syn.METRIC_NAMES), save_path=str(save_path),
            collate_fn=syn.collate)
        analyzer.run_map()
    analyzer.run_reduce()


def main() -> None:
    import deepspeed

    write_index_cases(HERE / "index")
    with tempfile.TemporaryDirectory() as tmp:
        two, one = Path(tmp) / "two", Path(tmp) / "one"
        run_analyzer(two, 2)
        run_analyzer(one, 1)
        out = HERE / "analyzer"
        shutil.rmtree(out, ignore_errors=True)
        for rel in final_files(two):
            assert filecmp.cmp(two / rel, one / rel, shallow=False), rel
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(two / rel, out / rel)
    versions = {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
                "numpy": np.__version__}
    (HERE / "version.json").write_text(json.dumps(versions, indent=1) + "\n")
    print("wrote", HERE / "index", HERE / "analyzer", versions)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # DeepSpeed's CPU build sometimes aborts at interpreter teardown

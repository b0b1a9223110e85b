"""deepshard.data_efficiency.index_files: the MMIDIDX ``.idx``/``.bin`` pair round-trips, and
equals byte for byte what DeepSpeed 0.19.8 writes for the same rows (fixtures written by
``tests/data/data_efficiency/make_index_fixtures.py``), which deepshard reads back."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from deepshard.data_efficiency.index_files import (
    DTYPE_CODES,
    fit_int_dtype,
    index_dtype,
    index_exists,
    open_index,
    write_index,
    write_index_concatenated,
)
from deepshard.errors import UsageError
from tests.data.data_efficiency import synthetic as syn
from tests.helpers import ROOT

FIXTURES = ROOT / "tests" / "data" / "data_efficiency"


def random_rows(dtype: np.dtype, count: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)
    return [rng.integers(info.min, info.max, size=rng.integers(0, 9), dtype=dtype,
                         endpoint=True) for _ in range(count)]


@pytest.mark.parametrize("dtype", list(DTYPE_CODES.values()), ids=lambda d: d.name)
def test_round_trip(tmp_path, dtype):
    rows = random_rows(dtype, 30)
    write_index(tmp_path / "rows", rows, dtype)
    got = open_index(tmp_path / "rows")
    assert len(got) == 30 and got.dtype == dtype
    assert got.sizes.tolist() == [len(r) for r in rows]
    assert got.doc_idx.tolist() == [0, 30]
    for want, row, it in zip(rows, (got[i] for i in range(30)), got, strict=True):
        assert row.dtype == dtype and np.array_equal(row, want) and np.array_equal(it, want)
    assert np.array_equal(got[-1], rows[-1])
    assert [r.tolist() for r in got[3:7]] == [r.tolist() for r in rows[3:7]]
    with pytest.raises(IndexError):
        got[30]
    with pytest.raises(ValueError, match="read-only"):
        got[0][...] = 0
    assert index_exists(tmp_path / "rows") and not index_exists(tmp_path / "other")


def test_rows_are_flattened_and_tensors_accepted(tmp_path):
    rows = [torch.arange(6).reshape(2, 3), np.array(7), [1, 2], np.zeros((0, 4))]
    write_index(str(tmp_path / "mixed"), rows, torch.int16, doc_idx=[0, 1, 4])
    got = open_index(str(tmp_path / "mixed"))
    assert [r.tolist() for r in got] == [[0, 1, 2, 3, 4, 5], [7], [1, 2], []]
    assert got.dtype == np.int16 and got.doc_idx.tolist() == [0, 1, 4]


def test_concatenated_rows_write_the_same_files(tmp_path):
    rows = random_rows(np.dtype(np.uint32), 12, seed=3)
    write_index(tmp_path / "a", rows, np.uint32)
    write_index_concatenated(tmp_path / "b", np.concatenate(rows), [len(r) for r in rows],
                             "uint32")
    for ext in ("idx", "bin"):
        assert (tmp_path / f"a.{ext}").read_bytes() == (tmp_path / f"b.{ext}").read_bytes()


@pytest.mark.parametrize("case", sorted(syn.INDEX_CASES))
def test_written_files_equal_deepspeeds(tmp_path, case):
    dtype, rows, doc_idx = syn.INDEX_CASES[case]
    write_index(tmp_path / case, [np.array(r, dtype=dtype) for r in rows], dtype,
                doc_idx=doc_idx)
    for ext in ("idx", "bin"):
        written = (tmp_path / f"{case}.{ext}").read_bytes()
        assert written == (FIXTURES / "index" / f"{case}.{ext}").read_bytes(), ext


@pytest.mark.parametrize("case", sorted(syn.INDEX_CASES))
def test_reads_deepspeeds_files(case):
    dtype, rows, doc_idx = syn.INDEX_CASES[case]
    got = open_index(FIXTURES / "index" / case)
    assert got.dtype == dtype and got.doc_idx.tolist() == doc_idx
    assert [r.tolist() for r in got] == rows


def test_reads_deepspeeds_analyzer_output():
    lengths = [len(r) for r in syn.token_rows()]
    sample_to_metric = open_index(FIXTURES / "analyzer" / "seqlen" / "seqlen_sample_to_metric")
    assert [r.tolist() for r in sample_to_metric] == [[n] for n in lengths]
    vocab = open_index(FIXTURES / "analyzer" / "vocab_count" / "vocab_count_metric_value")
    assert len(vocab) == 1 and int(vocab[0].sum()) == sum(lengths)


def test_pickles_as_its_path(tmp_path):
    write_index(tmp_path / "p", [[1, 2], [3]], np.int64)
    clone = pickle.loads(pickle.dumps(open_index(tmp_path / "p")))
    assert len(pickle.dumps(open_index(tmp_path / "p"))) < 200
    assert [r.tolist() for r in clone] == [[1, 2], [3]]


def test_a_failed_write_leaves_the_old_files(tmp_path):
    write_index(tmp_path / "keep", [[1], [2]], np.uint8)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def rows():
        yield np.array([5])
        raise RuntimeError("source broke")

    with pytest.raises(RuntimeError, match="source broke"):
        write_index(tmp_path / "keep", rows(), np.uint8)
    with pytest.raises(UsageError, match="cannot hold exactly"):
        write_index(tmp_path / "keep", [[1], [256]], np.uint8)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


@pytest.mark.parametrize(("values", "dtype"), [
    ([-1], np.uint8), ([1.5], np.int64), ([2**63], np.int64), ([-(2**31) - 1], np.int32)])
def test_values_a_dtype_cannot_hold_are_refused(tmp_path, values, dtype):
    with pytest.raises(UsageError, match="row 0 has values that"):
        write_index(tmp_path / "x", [np.array(values)], dtype)


@pytest.mark.parametrize("dtype", [np.float32, "bool", torch.float16, "nonsense"])
def test_only_the_formats_integer_dtypes_are_stored(dtype):
    with pytest.raises(UsageError, match="cannot be stored in an index file") as info:
        index_dtype(dtype)
    assert "uint64" in str(info.value)


def test_index_dtype_takes_numpy_torch_and_names():
    assert index_dtype(torch.int64) == index_dtype("int64") == index_dtype(np.int64) == np.int64
    assert index_dtype(torch.uint8) == np.uint8


def corrupt(tmp_path, how):
    prefix = tmp_path / "bad"
    write_index(prefix, [[1, 2, 3], [4]], np.int32)
    idx, bin_ = tmp_path / "bad.idx", tmp_path / "bad.bin"
    raw = bytearray(idx.read_bytes())
    if how == "no idx":
        idx.unlink()
    elif how == "no bin":
        bin_.unlink()
    elif how == "magic":
        idx.write_bytes(b"TNTIDX\x00\x00" + raw[8:])
    elif how == "version":
        raw[9] = 2
        idx.write_bytes(raw)
    elif how == "code":
        raw[17] = 9
        idx.write_bytes(raw)
    elif how == "truncated idx":
        idx.write_bytes(raw[:-4])
    elif how == "short bin":
        bin_.write_bytes(bin_.read_bytes()[:-4])
    return prefix


@pytest.mark.parametrize(("how", "message", "file"), [
    ("no idx", "index file not found", "bad.idx"),
    ("no bin", "index file not found", "bad.bin"),
    ("magic", "not an MMIDIDX index file", "bad.idx"),
    ("version", "index file version 2", "bad.idx"),
    ("code", "unknown dtype code 9", "bad.idx"),
    ("truncated idx", "its header says", "bad.idx"),
    ("short bin", "do not match the rows", "bad.bin"),
])
def test_missing_or_corrupt_files_are_usage_errors(tmp_path, how, message, file):
    prefix = corrupt(tmp_path, how)
    with pytest.raises(UsageError, match=message) as info:
        open_index(prefix)
    assert info.value.where == str(tmp_path / file) and info.value.hint


@pytest.mark.parametrize(("low", "high", "want"), [
    (0, 0, np.uint8), (0, 255, np.uint8), (0, 256, np.uint16), (5, 65535, np.uint16),
    (0, 65536, np.uint32), (0, 2**32 - 1, np.uint32), (0, 2**32, np.uint64),
    (-1, 0, np.int8), (-128, 127, np.int8), (-129, 0, np.int16), (-1, 128, np.int16),
    (-1, 32768, np.int32), (-(2**31), 2**31 - 1, np.int32), (-1, 2**31, np.int64),
])
def test_fit_int_dtype_follows_deepspeeds_thresholds(low, high, want):
    assert fit_int_dtype(low, high) == want

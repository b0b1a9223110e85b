"""The synthetic data behind the index and analyzer fixtures of this folder, shared by
``make_index_fixtures.py`` (run with DeepSpeed) and deepshard's tests (run without it).

Everything is a pure function of a small linear congruential generator, so the rows do not
depend on numpy's or torch's random streams.
"""

from __future__ import annotations

import numpy as np
import torch

VOCAB = 50
NUM_SAMPLES = 240
BATCH_SIZE = 16
MAX_LEN = 40

# the analyzer fixture's metrics: name, type, and the function of a batch (a list of rows)
METRIC_NAMES = ["seqlen", "tokensum", "first_offset", "vocab_count"]
METRIC_TYPES = ["single_value_per_sample", "single_value_per_sample", "single_value_per_sample",
                "accumulate_value_over_samples"]


def _lcg(seed: int):
    state = seed
    while True:
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        yield state >> 33


def token_rows(num_samples: int = NUM_SAMPLES) -> list[np.ndarray]:
    """``num_samples`` variable-length rows of token ids in ``[0, VOCAB)`` (int64)."""
    draw = _lcg(1234)
    rows = []
    for _ in range(num_samples):
        length = 1 + next(draw) % MAX_LEN
        rows.append(np.array([next(draw) % VOCAB for _ in range(length)], dtype=np.int64))
    return rows


class TokenDataset(torch.utils.data.Dataset):
    """A map-style dataset of :func:`token_rows`, each item a 1-D int64 tensor."""

    def __init__(self, num_samples: int = NUM_SAMPLES):
        self.rows = [torch.from_numpy(r) for r in token_rows(num_samples)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.rows[i]


def collate(batch: list[torch.Tensor]) -> list[torch.Tensor]:
    """Keep a batch as its list of rows (they differ in length)."""
    return list(batch)


def seqlen(batch: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([len(r) for r in batch], dtype=torch.int64)


def tokensum(batch: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([r.sum() for r in batch]).to(torch.int64)


def first_offset(batch: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([r[0] - VOCAB // 2 for r in batch]).to(torch.int64)


def vocab_count(batch: list[torch.Tensor]) -> torch.Tensor:
    return torch.bincount(torch.cat(batch), minlength=VOCAB).to(torch.int64)


METRIC_FUNCTIONS = [seqlen, tokensum, first_offset, vocab_count]


# the index-file fixture: case name -> (numpy dtype, rows, document index)
INDEX_CASES: dict[str, tuple[type, list[list[int]], list[int]]] = {
    "uint8_docs": (np.uint8, [[1], [2, 3], [], [255, 0, 4]], [0, 2, 3, 4]),
    "int8": (np.int8, [[-128, 127, 0], [-1]], [0, 2]),
    "int16": (np.int16, [[-32768], [32767, 5, 6]], [0, 2]),
    "int32": (np.int32, [[-(2**31), 2**31 - 1], [], [9]], [0, 3]),
    "int64": (np.int64, [[2**40, -5], [3], [-(2**63)]], [0, 3]),
    "uint16": (np.uint16, [[0, 1, 2], [65535], [], [7] * 5], [0, 4]),
    "uint32": (np.uint32, [[2**32 - 1, 0]], [0, 1]),
    "uint64": (np.uint64, [[2**63 + 5], [1, 2]], [0, 2]),
    "int32_no_rows": (np.int32, [], [0, 0]),
}

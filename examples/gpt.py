"""A small GPT and a byte-level corpus that every machine has: Python's own standard library.

Used by ``examples/train_gpt.py``, the runtime tests and ``benchmarks/train.py``. The
reference size (``GPTConfig()``: 6 layers, d_model 512, 8 heads, MLP 4x, vocab 8192,
sequence 128) has 27.4M parameters.

Data order is a pure function of ``(seed, global sample index)``: sample ``i`` is the
window of the corpus starting at ``hash(seed, i)``. So a step's global batch is the same
whatever the parallel layout, and loss curves from different layouts can be compared.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Model shape; the defaults are the reference size the benchmarks use."""

    vocab_size: int = 8192
    seq_len: int = 128
    n_layer: int = 6
    n_head: int = 8
    d_model: int = 512
    mlp_ratio: int = 4
    dropout: float = 0.0


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a GeLU MLP."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.fc_out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_head, d // self.n_head).unbind(2)
        drop = self.dropout if self.training else 0.0
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True, dropout_p=drop)
        x = x + F.dropout(self.proj(att.transpose(1, 2).reshape(b, t, d)), drop, self.training)
        return x + F.dropout(self.fc_out(F.gelu(self.fc(self.ln2(x)))), drop, self.training)


class GPT(nn.Module):
    """Token + learned position embeddings, ``n_layer`` blocks, final norm, untied head.

    ``forward(idx, targets)`` returns the mean cross-entropy; without targets, the logits.
    ``checkpoint``, when given, wraps each block's call (activation checkpointing), e.g.
    ``deepshard.checkpointing.checkpoint``.
    """

    def __init__(self, cfg: GPTConfig, checkpoint: Callable | None = None):
        super().__init__()
        self.cfg, self.checkpoint = cfg, checkpoint
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(_init_weights)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = self.checkpoint(block, x) if self.checkpoint else block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def stdlib_corpus(max_bytes: int = 4 << 20) -> np.ndarray:
    """The first ``max_bytes`` of the standard library's ``.py`` files, in sorted path order."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages"))
        for name in sorted(filenames):
            if name.endswith(".py") and total < max_bytes:
                with open(os.path.join(dirpath, name), "rb") as f:
                    chunks.append(f.read(max_bytes - total))
                total += len(chunks[-1])
    if total < 1 << 16:
        raise RuntimeError(f"found only {total} bytes of Python source under {root}")
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):  # the hash relies on wrap-around multiplication
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def sample_batch(corpus: np.ndarray, indices: np.ndarray, seed: int,
                 seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets for the given global sample indices."""
    salt = _splitmix64(np.array([seed], dtype=np.uint64))
    keys = _splitmix64(np.asarray(indices, dtype=np.uint64) ^ salt)
    starts = (keys % np.uint64(len(corpus) - seq_len - 1)).astype(np.int64)
    windows = corpus[starts[:, None] + np.arange(seq_len + 1)]
    tokens = torch.from_numpy(windows.astype(np.int64))
    return tokens[:, :-1], tokens[:, 1:]


def rank_indices(step: int, micro_step: int, dp_rank: int, dp_size: int, micro: int,
                 accumulation: int) -> np.ndarray:
    """Global sample indices of one rank's micro-batch: step ``step`` owns a contiguous range."""
    global_batch = micro * accumulation * dp_size
    first = step * global_batch + (micro_step * dp_size + dp_rank) * micro
    return np.arange(first, first + micro, dtype=np.uint64)

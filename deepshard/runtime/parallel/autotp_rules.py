"""AutoTP's name rules: what a layer's attribute name says about its role (pure).

Only the last component of a qualified name counts (``blocks.3.qkv`` -> ``qkv``). The
tables cover the common GPT-style families: nanoGPT / this repo's ``examples/gpt.py``
(``qkv``, ``proj``, ``fc``, ``fc_out``), GPT-2 (``c_attn``, ``c_proj``, ``c_fc``),
LLaMA / Mistral / Qwen (``q_proj`` ... ``down_proj``), Meta's reference LLaMA
(``wq`` ... ``w3``), GPT-J / GPT-NeoX (``fc_in``, ``dense_h_to_4h`` ...), Phi-3
(``qkv_proj``, ``gate_up_proj``). A name in none of them is *unknown*: AutoTP then falls
back to shapes, or keeps the layer replicated.
"""

from __future__ import annotations

from enum import Enum

from torch import nn


class Role(Enum):
    """What a Linear does inside a transformer block, judged from its name."""

    FUSED_QKV = "fused_qkv"
    """q, k and v stacked along the output rows ``[q; k; v]``: split each by heads."""
    ATTN_IN = "attn_in"
    """One of q, k, v: reads the block's (normalised) input."""
    MLP_IN = "mlp_in"
    """An MLP input projection (up, gate, fc1): reads the block's input."""
    FUSED_MLP_IN = "fused_mlp_in"
    """Gate and up stacked ``[gate; up]``: split each half on its own."""
    ATTN_OUT = "attn_out"
    """Writes attention's output back to the residual stream."""
    MLP_OUT = "mlp_out"
    """Writes the MLP's output back to the residual stream."""
    OUT = "out"
    """Writes back to the residual stream, from attention or the MLP (decided by width)."""
    UNKNOWN = "unknown"


_ROLES: dict[Role, frozenset[str]] = {
    Role.FUSED_QKV: frozenset({"qkv", "c_attn", "qkv_proj", "Wqkv"}),
    Role.ATTN_IN: frozenset({"q", "k", "v", "q_proj", "k_proj", "v_proj", "query", "key",
                             "value", "wq", "wk", "wv"}),
    Role.MLP_IN: frozenset({"fc", "fc1", "fc_in", "c_fc", "up", "up_proj", "gate",
                            "gate_proj", "w1", "w3", "dense_h_to_4h", "lin1", "wi", "wi_0",
                            "wi_1"}),
    Role.FUSED_MLP_IN: frozenset({"gate_up_proj"}),
    Role.ATTN_OUT: frozenset({"o_proj", "out_proj", "o", "attn_out"}),
    Role.MLP_OUT: frozenset({"fc_out", "fc2", "down", "down_proj", "w2", "dense_4h_to_h",
                             "lin2"}),
    Role.OUT: frozenset({"proj", "c_proj", "wo"}),
}

COLUMN_ROLES = frozenset({Role.FUSED_QKV, Role.ATTN_IN, Role.MLP_IN, Role.FUSED_MLP_IN})
ROW_ROLES = frozenset({Role.ATTN_OUT, Role.MLP_OUT, Role.OUT})
Q_NAMES = frozenset({"q", "q_proj", "query", "wq"})

HEAD_NAMES = frozenset({"head", "lm_head", "output", "embed_out"})
TOKEN_EMBEDDING_NAMES = frozenset({"tok_emb", "wte", "embed_tokens", "word_embeddings",
                                   "tok_embeddings", "embed_in", "token_embedding"})
POSITION_EMBEDDING_NAMES = frozenset({"pos_emb", "wpe", "position_embeddings",
                                      "embed_positions", "pos_embedding"})

HEAD_ATTRS = ("n_head", "num_heads", "num_attention_heads", "n_heads")
"""Attributes holding an attention module's number of (query) heads, looked up in order."""
KV_HEAD_ATTRS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "n_kv_head")
"""Attributes holding the number of key/value heads (grouped-query attention)."""
WIDTH_ATTRS = ("split_size", "inner_dim", "all_head_size")
"""Attributes of an attention module holding the width of its q (heads x head size), which
its forward splits or reshapes by: divided with the head count when they equal q's width
(GPT-2's ``split_size``, T5's ``inner_dim``, BERT's ``all_head_size``)."""


def leaf(name: str) -> str:
    """The last component of a qualified module name."""
    return name.rsplit(".", 1)[-1]


def role_of(name: str) -> Role:
    """The role a Linear's (qualified) name suggests."""
    short = leaf(name)
    for role, names in _ROLES.items():
        if short in names:
            return role
    return Role.UNKNOWN


def head_attrs(module: nn.Module) -> tuple[tuple[str, int] | None, tuple[str, int] | None]:
    """``(attribute, value)`` of the query-head count and of the key/value-head count found
    on ``module`` (each ``None`` when absent). Only plain positive ints count."""

    def find(names: tuple[str, ...]) -> tuple[str, int] | None:
        for attr in names:
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return attr, value
        return None

    return find(HEAD_ATTRS), find(KV_HEAD_ATTRS)


def config_heads(module: nn.Module) -> tuple[tuple[str, int], tuple[str, int]] | None:
    """The head counts of an HF attention module that keeps none on itself.

    Since transformers 4.48 (LLaMA, Qwen2, Mistral, ...) the attention module holds only
    ``head_dim`` and its ``config``, and reshapes q/k/v into ``-1`` heads of ``head_dim``:
    a rank holding whole heads computes them with no attribute changed. Returns
    ``(("config.num_attention_heads", H), ("config.num_key_value_heads", KV))``, or None
    when the module has no integer ``head_dim`` or its config no head count.
    """
    cfg = getattr(module, "config", None)
    head_dim = getattr(module, "head_dim", None)
    heads = getattr(cfg, "num_attention_heads", None)
    if not (isinstance(head_dim, int) and isinstance(heads, int) and heads > 0):
        return None
    kv = getattr(cfg, "num_key_value_heads", None)
    kv = kv if isinstance(kv, int) and kv > 0 else heads
    return ("config.num_attention_heads", heads), ("config.num_key_value_heads", kv)


def block_names(model: nn.Module) -> frozenset[str]:
    """Qualified names of the repeated layers: the items of every ``nn.ModuleList`` and
    ``nn.Sequential`` (a transformer's blocks)."""
    found: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            found.update(f"{name}.{child}" if name else child
                         for child, _ in module.named_children())
    return frozenset(found)


def in_block(name: str, blocks: frozenset[str]) -> bool:
    """Whether the module ``name`` lies strictly inside one of ``blocks``."""
    parts = name.split(".")
    return any(".".join(parts[:i]) in blocks for i in range(1, len(parts)))

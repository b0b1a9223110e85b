"""The tiny causal attention LM and token data the Ulysses compat script trains, in plain
torch (kept apart from the script, as ``tiny_models.py``, so the single-process reference
builds the very same module and data without importing ``deepspeed``).

Tensors inside the attention are ``[batch, seq, heads, head_dim]``, the layout
``DistributedAttention(..., batch_dim_idx=0)`` takes; the model calls its ``attention``
with DeepSpeed's forward arguments ``(query, key, value, batch_dim_idx)``.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, HEADS, MAX_LEN = 32, 16, 4, 16


def causal_attention(query, key, value, *args, **kwargs):
    """The local attention: causal softmax attention over ``[b, s, h, d]``."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2)


class PlainAttention(nn.Module):
    """Attention over the whole sequence in one process: DistributedAttention's
    signature without the exchange."""

    def forward(self, query, key, value, batch_dim_idx, *args, **kwargs):
        return causal_attention(query, key, value)


class TinyAttentionLM(nn.Module):
    """Embeddings (token + learned position from ``position_ids``), one pre-norm
    attention block, an output head. ``attention``: the module that attends (default:
    :class:`PlainAttention`)."""

    def __init__(self, attention=None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(MAX_LEN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        # no bias: a key bias has no gradient but rounding noise, which Adam would amplify
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.attention = attention if attention is not None else PlainAttention()

    def forward(self, input_ids, position_ids):
        x = self.embed(input_ids) + self.pos(position_ids)
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, HEADS, HIDDEN // HEADS).unbind(2)
        context = self.attention(q, k, v, 0)
        x = x + self.proj(context.reshape(b, s, HIDDEN))
        return self.head(x)


class TokenDataset(torch.utils.data.Dataset):
    """``count`` random sequences of ``seq_len`` tokens as dict samples (``input_ids``,
    ``labels`` = the inputs: the adapter shifts them, ``position_ids``)."""

    def __init__(self, count, seq_len=8, seed=7):
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (count, seq_len), generator=g)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        ids = self.tokens[index]
        return {"input_ids": ids, "labels": ids.clone(),
                "position_ids": torch.arange(len(ids))}

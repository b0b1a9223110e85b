"""Small GPT-style models with the naming of real families, for AutoTP's tests.

- :func:`head_gpt`: ``examples/gpt.py``'s GPT whose blocks reshape with ``n_head`` and
  ``-1`` (the example's own Block reshapes with its input's full width).
- :class:`GPT2Like`: Hugging Face GPT-2 names (``transformer.wte/wpe/h``, ``attn.c_attn``,
  ``attn.c_proj``, ``mlp.c_fc``, ``mlp.c_proj``), ``num_heads``, LM head tied to ``wte``.
- :class:`LlamaLike`: LLaMA names (``model.embed_tokens``, ``self_attn.q_proj/k_proj/
  v_proj/o_proj``, ``mlp.gate_proj/up_proj/down_proj``), grouped-query attention
  (``num_heads``, ``num_key_value_heads``) whose forward takes the attention bias as a
  second input, RMSNorm; ``fused=True`` gives Phi-3's ``qkv_proj`` and ``gate_up_proj``.

Every model's ``forward(idx, targets=None)`` returns the mean cross-entropy, or the logits.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from gpt import GPT, Block, GPTConfig


class HeadBlock(Block):
    """examples/gpt.py's Block with reshapes that follow ``n_head``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_head, -1).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, -1))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


def head_gpt(cfg: GPTConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(cfg)
    model.blocks = nn.ModuleList(HeadBlock(cfg) for _ in range(cfg.n_layer))
    for module in model.blocks.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
    return model


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
    if targets is None:
        return logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class GPT2Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.num_heads, self.head_dim = heads, d // heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (s.view(b, t, self.num_heads, self.head_dim).transpose(1, 2) for s in
                   self.c_attn(x).split(self.num_heads * self.head_dim, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, -1))


class GPT2MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d), GPT2Attention(d, heads)
        self.ln_2, self.mlp = nn.LayerNorm(d), GPT2MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Like(nn.Module):
    def __init__(self, vocab: int = 256, seq: int = 16, d: int = 64, heads: int = 4,
                 layers: int = 2, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(vocab, d)
        self.transformer.wpe = nn.Embedding(seq, d)
        self.transformer.h = nn.ModuleList(GPT2Block(d, heads) for _ in range(layers))
        self.transformer.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        tr = self.transformer
        x = tr.wte(idx) + tr.wpe(torch.arange(idx.shape[1]))
        for block in tr.h:
            x = block(x)
        return _lm_loss(self.lm_head(tr.ln_f(x)), targets)


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, fused: bool):
        super().__init__()
        self.num_heads, self.num_key_value_heads = heads, kv_heads
        self.head_dim, self.fused = d // heads, fused
        q, kv = heads * self.head_dim, kv_heads * self.head_dim
        if fused:
            self.qkv_proj = nn.Linear(d, q + 2 * kv, bias=False)
        else:
            self.q_proj = nn.Linear(d, q, bias=False)
            self.k_proj = nn.Linear(d, kv, bias=False)
            self.v_proj = nn.Linear(d, kv, bias=False)
        self.o_proj = nn.Linear(q, d, bias=False)

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q_size, kv_size = (self.num_heads * self.head_dim,
                           self.num_key_value_heads * self.head_dim)
        if self.fused:
            q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b, t, -1, self.head_dim).transpose(1, 2)
        k, v = (s.view(b, t, -1, self.head_dim).transpose(1, 2) for s in (k, v))
        groups = self.num_heads // self.num_key_value_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class LlamaMLP(nn.Module):
    def __init__(self, d: int, ffn: int, fused: bool):
        super().__init__()
        self.fused = fused
        if fused:
            self.gate_up_proj = nn.Linear(d, 2 * ffn, bias=False)
        else:
            self.gate_proj = nn.Linear(d, ffn, bias=False)
            self.up_proj = nn.Linear(d, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class LlamaLayer(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, ffn: int, fused: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(d)
        self.self_attn = LlamaAttention(d, heads, kv_heads, fused)
        self.post_attention_layernorm = RMSNorm(d)
        self.mlp = LlamaMLP(d, ffn, fused)

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), attn_bias)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaLike(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 64, heads: int = 8, kv_heads: int = 4,
                 ffn: int = 96, layers: int = 2, fused: bool = False, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, d)
        self.model.layers = nn.ModuleList(LlamaLayer(d, heads, kv_heads, ffn, fused)
                                          for _ in range(layers))
        self.model.norm = RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        bias = torch.full((t, t), float("-inf")).triu(1)
        x = self.model.embed_tokens(idx)
        for layer in self.model.layers:
            x = layer(x, bias)
        return _lm_loss(self.lm_head(self.model.norm(x)), targets)

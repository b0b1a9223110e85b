"""Tiny HF models built from configs (no downloads) and saved as a user's checkpoint would
be: ``model.safetensors`` or sharded safetensors with their index, plus ``config.json``."""

from __future__ import annotations

from pathlib import Path

KINDS = ("llama", "gpt2", "qwen2")


def tiny_config(kind: str, **overrides):
    """A few-layer config of ``kind``: Llama (tied embeddings), GPT-2, Qwen2 (GQA)."""
    import transformers

    if kind == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
            tie_word_embeddings=True)
    elif kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4,
                                      n_positions=64, bos_token_id=0, eos_token_id=1)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            tie_word_embeddings=False)
    else:
        raise ValueError(f"unknown kind {kind!r}; one of {KINDS}")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def save_tiny(kind: str, path: Path, seed: int = 0, max_shard_size: str | None = None,
              **overrides) -> Path:
    """Build a tiny ``kind`` causal LM with seeded weights and ``save_pretrained`` it to
    ``path`` (sharded when ``max_shard_size`` is given, e.g. ``"20KB"``)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind, **overrides))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


def batch(vocab: int = 128, n: int = 4, seq: int = 16, seed: int = 1):
    """Token ids and labels for a causal LM step."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}

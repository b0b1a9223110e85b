"""Tiny HF models built from configs for the inference tests, saved as HF directories
(safetensors + a word-level tokenizer, so ``pipeline(...)`` works with no download).

Head counts divide by 4 (the largest tensor-parallel size tested); GPT-2's vocabulary is odd,
like the real one's 50,257, so its embedding and LM head are split with padding.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 257
ODD_VOCAB = 251


def configs() -> dict:
    """Model family -> (auto class name, config)."""
    import transformers as T

    small = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": VOCAB,
             "max_position_embeddings": 128, "tie_word_embeddings": False}
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    return {
        "llama": ("AutoModelForCausalLM", T.LlamaConfig(**small, **ids)),
        "qwen2": ("AutoModelForCausalLM", T.Qwen2Config(**small, **ids)),
        "gpt2": ("AutoModelForCausalLM", T.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=ODD_VOCAB, n_positions=128, **ids)),
        "t5": ("AutoModelForSeq2SeqLM", T.T5Config(
            num_layers=2, num_decoder_layers=2, d_model=64, d_ff=128, num_heads=4, d_kv=16,
            vocab_size=VOCAB, decoder_start_token_id=0, **ids)),
    }


def tokenizer(vocab_size: int):
    """A word-level tokenizer whose words are ``w0 ... w{n-1}`` (``<pad>``, ``<s>``,
    ``</s>`` first)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<pad>")


def save_models(root: Path, families: list[str] | None = None) -> dict[str, Path]:
    """Build (seed 0) and save each family under ``root``; returns family -> directory."""
    import transformers as T

    out = {}
    for family, (auto, config) in configs().items():
        if families and family not in families:
            continue
        torch.manual_seed(0)
        model = getattr(T, auto).from_config(config)
        path = root / family
        model.save_pretrained(path)
        tokenizer(config.vocab_size).save_pretrained(path)
        out[family] = path
    return out

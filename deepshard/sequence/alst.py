"""ALST's memory switches applied to a Hugging Face causal LM (Llama, Qwen2, Mistral...).

``deepshard.initialize`` calls :func:`apply_alst` with the config's ``sequence_parallel``
section; a hand loop can call it on its model directly. Each switch changes one instance
(its ``forward`` or checkpoint function), never a transformers class, so two models in one
process do not affect each other:

- ``tiled_mlp_compute``: every MLP with ``gate_proj``/``up_proj``/``down_proj`` runs through
  :func:`~deepshard.sequence.tiled.tiled_mlp`;
- ``tiled_logits_loss``: the causal LM's forward, when given ``labels`` (or HF's
  ``shift_labels``), runs the decoder and then
  :func:`~deepshard.sequence.tiled.tiled_logits_loss` over its ``lm_head``: the result has
  the loss HF would compute and ``logits=None``; without labels the forward is HF's own;
- ``activation_checkpoint_cpu_offload``: :func:`~deepshard.sequence.offload.
  offload_gradient_checkpointing`.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F

from deepshard.errors import UsageError
from deepshard.sequence.offload import offload_gradient_checkpointing
from deepshard.sequence.tiled import tiled_logits_loss, tiled_mlp

__all__ = ["apply_alst", "tile_causal_lm_loss", "tile_mlps"]

_WHERE = "sequence_parallel"


def _is_gated_mlp(module: torch.nn.Module) -> bool:
    return all(isinstance(getattr(module, n, None), torch.nn.Module)
               for n in ("gate_proj", "up_proj", "down_proj"))


def tile_mlps(model: torch.nn.Module, shards: int | None = None) -> int:
    """Route every gated MLP of ``model`` through :func:`tiled_mlp`; returns how many.

    Raises:
        UsageError: ``model`` has no such MLP.
    """
    count = 0
    for module in model.modules():
        if not _is_gated_mlp(module) or getattr(module, "_deepshard_tiled", False):
            continue
        plain = module.forward

        def forward(self, x, _plain=plain):
            return tiled_mlp(self, x, shards, fn=lambda _m, t: _plain(t))

        module.forward = types.MethodType(forward, module)
        module._deepshard_tiled = True
        count += 1
    if not count:
        raise UsageError(f"tiled_mlp_compute found no MLP (a module with gate_proj, up_proj "
                         f"and down_proj) in {type(model).__name__}",
                         where=f"{_WHERE}.tiled_mlp_compute",
                         hint="tile your own MLP with deepshard.sequence.tiled.tiled_mlp, or "
                              "set the key to false")
    return count


def _decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    get_decoder = getattr(model, "get_decoder", None)
    head = getattr(model, "lm_head", None)
    decoder = get_decoder() if callable(get_decoder) else None
    config = getattr(model, "config", None)
    if decoder is None or not isinstance(head, torch.nn.Linear) or decoder is model:
        raise UsageError(f"tiled_logits_loss needs a Hugging Face causal LM (a decoder and "
                         f"an lm_head Linear); {type(model).__name__} is not one",
                         where=f"{_WHERE}.tiled_logits_loss",
                         hint="compute the loss with deepshard.sequence.tiled."
                              "tiled_logits_loss yourself, or set the key to false")
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale",
                                                                   None):
        raise UsageError(f"tiled_logits_loss computes plain logits, but "
                         f"{type(model).__name__} scales or caps them",
                         where=f"{_WHERE}.tiled_logits_loss", hint="set the key to false")
    return decoder, head


def _shifted(labels: torch.Tensor | None, shift_labels: torch.Tensor | None,
             ignore_index: int) -> torch.Tensor:
    if shift_labels is not None:
        return shift_labels
    assert labels is not None
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def tile_causal_lm_loss(model: torch.nn.Module, shards: int | None = None) -> None:
    """Make ``model(..., labels=...)`` compute its loss with :func:`tiled_logits_loss`."""
    decoder, head = _decoder_and_head(model)
    plain = model.forward

    def forward(self, input_ids=None, labels=None, *, shift_labels=None,
                num_items_in_batch=None, ignore_index: int = -100, **kwargs: Any):
        if labels is None and shift_labels is None:
            return plain(input_ids=input_ids, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        kwargs.pop("logits_to_keep", None)
        out = decoder(input_ids=input_ids, **kwargs)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        target = _shifted(labels, shift_labels, ignore_index).to(hidden.device)
        loss = tiled_logits_loss(hidden, head, target, shards=shards,
                                 ignore_index=ignore_index,
                                 num_items_in_batch=num_items_in_batch)
        return CausalLMOutputWithPast(loss=loss, logits=None,
                                      past_key_values=getattr(out, "past_key_values", None),
                                      hidden_states=getattr(out, "hidden_states", None),
                                      attentions=getattr(out, "attentions", None))

    model.forward = types.MethodType(forward, model)


def apply_alst(model: torch.nn.Module, options: Any) -> list[str]:
    """Apply the switches of a ``sequence_parallel`` section (or any object with its
    attributes) to ``model``; returns one line per switch applied, for the log."""
    done = []
    if getattr(options, "tiled_mlp_compute", False):
        count = tile_mlps(model, getattr(options, "tiled_mlp_shards", None))
        done.append(f"tiled MLP in {count} layers")
    if getattr(options, "tiled_logits_loss", False):
        tile_causal_lm_loss(model, getattr(options, "tiled_logits_shards", None))
        done.append("tiled logits + loss")
    if getattr(options, "activation_checkpoint_cpu_offload", False):
        offload_gradient_checkpointing(model)
        done.append("checkpointed activations offloaded to host memory")
    return done

"""The ``sequence_parallel`` config section: ALST's memory switches for long sequences.

``{"sequence_parallel": {"tiled_mlp_compute": true, "tiled_logits_loss": true,
"activation_checkpoint_cpu_offload": true}}`` in ``ds_config.json``; the engine applies
them to the model in :func:`deepshard.sequence.alst.apply_alst`. The names are
ArcticTraining's (``tiled_mlp_compute``, ``activation_checkpoint_cpu_offload``); DeepSpeed
itself has no config keys for them (its ``TiledMLP``/``TiledFusedLogitsLoss`` are called by
the training code). Each switch leaves the loss and the gradients as they are.
"""

from __future__ import annotations

from deepshard.config.schema_base import Bool, PosInt, Section, doc


class SequenceParallelConfig(Section):
    """``sequence_parallel``: tiling and offload that make long sequences fit."""

    tiled_mlp_compute: Bool = doc(
        "Run every gated MLP (gate_proj/up_proj/down_proj, as in Llama and Qwen2) over tiles "
        "of tokens, recomputing each tile in backward.", default=False)
    tiled_mlp_shards: PosInt | None = doc(
        "Tiles per MLP call; None: tiles of hidden_size tokens (DeepSpeed's rule).",
        default=None)
    tiled_logits_loss: Bool = doc(
        "Compute a causal LM's lm_head and cross-entropy tile by tile when it is given "
        "labels, never the whole [tokens, vocab] logits (the output's logits are None).",
        default=False)
    tiled_logits_shards: PosInt | None = doc(
        "Tiles over the tokens for the logits; None: tiles of at most 256 MiB of fp32 "
        "logits.", default=None)
    activation_checkpoint_cpu_offload: Bool = doc(
        "Keep the inputs of the model's gradient-checkpointed layers in host memory from "
        "forward to backward (needs model.gradient_checkpointing_enable()).", default=False)

    def any_enabled(self) -> bool:
        """Whether any switch is on."""
        return (self.tiled_mlp_compute or self.tiled_logits_loss
                or self.activation_checkpoint_cpu_offload)

"""Inference: ``deepshard.init_inference`` and the engine it returns.

A trained model, tensor-parallel over the ranks of a job (the AutoTP planner the training
side uses), its weights read straight into each rank's shard (an HF directory or a
deepshard/DeepSpeed checkpoint), generating through HF ``generate`` with its KV cache;
optionally with int8 weights and the fused attention/LayerNorm path.
"""

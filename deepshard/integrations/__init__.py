"""Integrations with the libraries DeepSpeed users train through.

:mod:`deepshard.integrations.transformers` is the one for HF Transformers (and PEFT):
``HfDeepShardConfig``, ``Trainer``, ``TrainingArguments``, ``save_pretrained``. It imports
transformers, which is an optional extra (``pip install deepshard[hf]``).
"""

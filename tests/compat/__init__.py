"""DeepSpeed users' scripts, run unchanged on deepshard (issue 18).

Every script in ``scripts/`` is written the way DeepSpeedExamples' are (``import
deepspeed``, argparse with ``--local_rank`` and DeepSpeed's config arguments, a JSON config
beside it) and runs under ``ds-run --num_gpus 2 --deepspeed_compat <script>
--deepspeed_config <json>`` on 2 gloo CPU ranks, where ``import deepspeed`` is deepshard.
Each test compares what the ranks saved with a plain-torch, single-process reference on
the whole global batch: fp32 cases at 1e-5 (max abs difference of per-step losses and
final weights), bf16 at tolerances derived from bf16 rounding.

- ``test_cifar_style``: training/cifar/cifar10_deepspeed.py — ``deepspeed.comm``
  (rank, world, barrier, all_reduce of the logged loss), ``get_accelerator()``,
  ``initialize(training_data=...)``'s dataloader, config Adam + WarmupLR + clipping;
  ZeRO 0 and 2 chosen by ``--stage``.
- ``test_pipeline``: training/pipeline_parallelism/train.py — LayerSpecs, a 2-stage
  ``PipelineModule`` (``seed_layers``), ``train_batch(data_iter=iter(RepeatingLoader(...)))``
  against gradient accumulation over the micro-batches in one process.
- ``test_gan``: training/gan/gan_deepspeed_train.py — two engines over client torch Adam
  optimizers, raw modules called, two ``backward``s before one ``step``, the generator's
  loss through the raw discriminator; ZeRO 0 and 2.
- ``test_bf16_backward``: training/bf16_master_weight/train.py with ``loss.backward();
  model_engine.step()`` at ZeRO 1 and 3: bitwise equal to ``model_engine.backward(loss)``,
  and within bf16 rounding of a plain-torch bf16 mixed-precision reference.

``scripts/tiny_models.py`` holds the models and synthetic data, shared by the scripts and
the references (it imports torch only). The same scripts also run under DeepSpeed 0.19.8
itself (``deepspeed --num_gpus 2 <script> ...`` with ``DS_ACCELERATOR=cpu``); that is a
manual check, not part of this suite.
"""

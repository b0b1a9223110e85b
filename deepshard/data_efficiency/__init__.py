"""Data efficiency: DeepSpeed's ``data_efficiency`` config section, in pure torch.

Curriculum learning (difficulty schedules, difficulty-indexed sampling over an index a
data analyzer builds, sequence-length truncation), random layerwise token dropping
(random-LTD) and dynamic batching by a token budget with the learning rate scaled to each
batch. A layer-5 feature: it plugs into the runtime through its extension
(:mod:`deepshard.data_efficiency.extension`).
"""

"""Training: the loop and the recipes that drive it.

The training loop (``train``), the DDP recipe for the image models (``recipe``) and the
GPT recipe with FSDP2 (``gpt_recipe``), the language-model helpers (``lm``), checkpoints
(``checkpoints``), preemption (``preemption``), seeding (``seeding``), the options a
training script takes (``cli``) and SyncBatchNorm's conversion (``sync_batchnorm``).
"""

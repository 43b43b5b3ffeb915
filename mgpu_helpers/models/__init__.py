"""Models the chapters train, one module each.

``cnn.py`` holds the seeds' CNN, the model of chapters 03 to 09. The small decoder-only
GPT of Part III (FSDP2, tensor, sequence, context and expert parallelism) will sit beside
it as ``gpt.py``, trained by the same loop: ``train.train_one_epoch`` takes a loss
function, so a model of tokens needs no loop of its own.
"""

from .cnn import SeedCNN, as_sequential

__all__ = ["SeedCNN", "as_sequential"]

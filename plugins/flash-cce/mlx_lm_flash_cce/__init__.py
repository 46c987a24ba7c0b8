"""flash-cce: cut cross-entropy for mlx-lm, without ``[tokens, vocab]`` logits.

    from mlx_lm_flash_cce import linear_cross_entropy, make_loss

``linear_cross_entropy(hidden, head, targets, ...)`` is the loss of
``head(hidden)``; ``make_loss(model)`` is a drop-in for mlx-lm's
``default_loss`` (``mlx_lm.lora --loss flash-cce``).
"""

__version__ = "0.1.0"

from .api import linear_cross_entropy  # noqa: E402
from .loss import make_loss  # noqa: E402

__all__ = ["linear_cross_entropy", "make_loss", "__version__"]

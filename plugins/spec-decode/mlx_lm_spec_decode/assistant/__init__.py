"""The assistant drafter: a small transformer that borrows the target's KV cache.

A 1-2 layer transformer drafts with the target's own context instead of its
own copy of it: it reads the K/V of the target's donor layers in place, the
target's final hidden state, embedding, lm-head and RoPE, and keeps K/V of
its own only for the chain it is drafting.

- ``config``: ``AssistantConfig`` and the errors (plain data).
- ``donors``: what it reads of the target (layers, caches, fingerprint) and
  ``make_config``, which sizes a new drafter for a target.
- ``net``: the network (``Assistant``) and its attention over a donor.
- ``drafter``: ``AssistantDrafter``, the verify loop's drafter.
- ``io``: the trained folder (``save``, ``read_config``, ``load``).

``mlx-lm-ext train-drafter`` (``mlx_lm_spec_decode.training``) trains one.
"""

from .config import (
    CONFIG_FILE,
    FORMAT,
    WEIGHTS_FILE,
    AssistantConfig,
    AssistantError,
    AssistantMismatch,
)
from .donors import (
    check_fingerprint,
    donor_layout,
    donor_view,
    embedding,
    find_donors,
    fingerprint,
    make_config,
    output_scale,
    rope_of,
    vocab_size,
)
from .drafter import AssistantDrafter
from .io import load, load_net, read_config, save
from .net import Assistant, attend, init_from_target

__all__ = [
    "CONFIG_FILE",
    "FORMAT",
    "WEIGHTS_FILE",
    "AssistantConfig",
    "AssistantError",
    "AssistantMismatch",
    "check_fingerprint",
    "donor_layout",
    "donor_view",
    "embedding",
    "find_donors",
    "fingerprint",
    "make_config",
    "output_scale",
    "rope_of",
    "vocab_size",
    "AssistantDrafter",
    "load",
    "load_net",
    "read_config",
    "save",
    "Assistant",
    "attend",
    "init_from_target",
]

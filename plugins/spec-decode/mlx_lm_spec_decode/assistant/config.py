"""The assistant drafter's config and errors: plain data, no MLX.

A trained drafter is one folder: ``assistant.safetensors`` (weights) and
``assistant.json`` (this config: shape, donor layers and the fingerprint of
the target it was trained for).
"""

from dataclasses import dataclass, field, fields
from typing import Any

FORMAT = 1
CONFIG_FILE = "assistant.json"
WEIGHTS_FILE = "assistant.safetensors"


class AssistantError(ValueError):
    """The assistant drafter cannot be built, loaded or used with this model."""


class AssistantMismatch(AssistantError):
    """The drafter folder was made for a different target model."""


@dataclass
class AssistantConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    intermediate_size: int
    donors: list  # target cache index each layer reads, one per layer
    windows: list  # sliding window of each donor (None: full attention)
    rms_norm_eps: float = 1e-5
    target: dict = field(default_factory=dict)  # donors.fingerprint(model)
    format: int = FORMAT

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AssistantConfig":
        # Unknown keys are ignored: a newer writer may add fields.
        names = {f.name for f in fields(cls)}
        cfg = cls(**{k: v for k, v in d.items() if k in names})
        if cfg.format != FORMAT:
            raise AssistantError(
                f"assistant format {cfg.format} is not supported (this version reads {FORMAT})"
            )
        if len(cfg.donors) != cfg.num_layers or len(cfg.windows) != cfg.num_layers:
            raise AssistantError(
                f"assistant config: {cfg.num_layers} layers but donors {cfg.donors}"
            )
        return cfg

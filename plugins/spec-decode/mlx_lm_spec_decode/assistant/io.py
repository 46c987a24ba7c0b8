"""Saving and loading a trained assistant drafter folder.

A folder holds ``assistant.safetensors`` (weights) and ``assistant.json``
(``AssistantConfig``, with the fingerprint of the target it was trained
for). ``load(path, model)`` refuses a folder made for another model.
"""

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .. import target as target_mod
from .config import CONFIG_FILE, WEIGHTS_FILE, AssistantConfig, AssistantError
from .donors import check_fingerprint, fingerprint
from .drafter import AssistantDrafter
from .net import Assistant

PathLike = Union[str, Path]


def save(
    path: PathLike, net: Assistant, cfg: AssistantConfig, dtype: Optional[mx.Dtype] = mx.float16
) -> None:
    """Write ``assistant.safetensors`` and ``assistant.json`` into ``path``
    (each through a temporary file, so a reader never sees half a folder)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weights = {
        k: v.astype(dtype) if dtype is not None else v for k, v in tree_flatten(net.parameters())
    }
    tmp = path / ("." + WEIGHTS_FILE + ".tmp.safetensors")
    mx.save_safetensors(str(tmp), weights, metadata={"format": "mlx"})
    tmp.replace(path / WEIGHTS_FILE)
    tmp = path / ("." + CONFIG_FILE + ".tmp")
    tmp.write_text(json.dumps(asdict(cfg), indent=1) + "\n")
    tmp.replace(path / CONFIG_FILE)


def read_config(path: PathLike) -> AssistantConfig:
    path = Path(path)
    f = path / CONFIG_FILE
    if not path.is_dir():
        raise AssistantError(f"assistant drafter folder {path} does not exist")
    if not f.is_file() or not (path / WEIGHTS_FILE).is_file():
        raise AssistantError(
            f"{path} is not an assistant drafter folder (needs {CONFIG_FILE} and {WEIGHTS_FILE}); "
            f"make one with mlx-lm-ext train-drafter"
        )
    try:
        return AssistantConfig.from_dict(json.loads(f.read_text()))
    except AssistantError:
        raise
    except (ValueError, TypeError, KeyError) as e:
        raise AssistantError(f"{f} is not a valid assistant config: {e}") from e


def load_net(path: PathLike, cfg: Optional[AssistantConfig] = None) -> Assistant:
    path = Path(path)
    cfg = cfg or read_config(path)
    net = Assistant(cfg)
    try:
        weights = mx.load(str(path / WEIGHTS_FILE))
        net.load_weights(list(weights.items()), strict=True)
    except Exception as e:
        raise AssistantError(
            f"{path / WEIGHTS_FILE} cannot be loaded into a {cfg.num_layers}-layer assistant: {e}"
        ) from e
    return net


def load(path: PathLike, model: nn.Module, **options: Any) -> AssistantDrafter:
    """An ``AssistantDrafter`` for ``model`` from a trained folder; raises
    ``AssistantMismatch`` if it was made for another model. ``options``:
    ``max_draft``, ``adaptive``, ``auto_off``, ``tree``."""
    cfg = read_config(path)
    split = target_mod.split(model)
    check_fingerprint(cfg.target, fingerprint(model, split), where=f"the drafter in {path}")
    net = load_net(path, cfg)
    return AssistantDrafter(model, net, cfg, split=split, **options)

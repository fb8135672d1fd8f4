"""Hugging Face causal language models as rayjobs models: ``model.name: hf:<local dir>``.

The directory holds a ``transformers`` ``config.json`` (and the weights as ``*.safetensors`` when
they should be loaded; without them the model starts from the config's initialization). Nothing is
downloaded and no code from the directory runs (``trust_remote_code`` stays off). The model is
wrapped so that it is called as every rayjobs model is: token ids in, logits out. Its parallel plan
names the decoder's repeated layers (found in the built model), so FSDP2 shards layer by layer
and activation checkpointing and pipeline stages have their blocks. ``transformers`` is the
optional extra ``rayjobs[hf]``.
"""

from __future__ import annotations

import functools
import glob
import os
from typing import Any

import torch
from torch import nn

PREFIX = "hf:"


class HFCausalLM(nn.Module):
    """A ``transformers`` causal LM called as rayjobs' models are: ``(batch, seq)`` ids -> logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, seq, vocab)``; no key/value cache (training)."""
        return self.model(input_ids=x, use_cache=False).logits


def is_hf(name: str) -> bool:
    """True for ``hf:<dir>``."""
    return name.startswith(PREFIX)


def directory(name: str) -> str:
    """The local directory of ``hf:<dir>`` (absolute; ``~`` expanded)."""
    return os.path.abspath(os.path.expanduser(name.removeprefix(PREFIX)))


def problems(name: str) -> list[str]:
    """Why ``hf:<dir>`` cannot be built here (transformers missing, no config.json): one line each."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return [f"{name} needs transformers: pip install 'rayjobs[hf]' (or transformers>=5)"]
    path = directory(name)
    if not os.path.isfile(os.path.join(path, "config.json")):
        return [f"{name}: no config.json in {path} (a transformers model directory; nothing is downloaded)"]
    return []


def _config(path: str, overrides: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False, **overrides)


def build(name: str, info: Any, **overrides: Any) -> nn.Module:
    """The causal LM of ``hf:<dir>`` (``overrides`` replace config fields), weights from its safetensors if any."""
    from transformers import AutoModelForCausalLM

    path = directory(name)
    config = _config(path, overrides)
    vocab = getattr(config, "vocab_size", 0)
    if info is not None and vocab < info.num_classes:
        raise ValueError(f"{name}: vocab_size {vocab} is smaller than the data's {info.num_classes} tokens")
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if info is not None and positions and info.input_shape and positions < info.input_shape[0]:
        raise ValueError(f"{name}: {positions} positions, but the data's sequences are {info.input_shape[0]} long")
    if glob.glob(os.path.join(path, "*.safetensors")) and torch.get_default_device().type != "meta":
        model = AutoModelForCausalLM.from_pretrained(path, config=config, local_files_only=True)
    else:
        model = AutoModelForCausalLM.from_config(config)
    return HFCausalLM(model)


@functools.lru_cache(maxsize=8)
def layers_attr(name: str) -> str:
    """The dotted path of the decoder's repeated layers in the wrapped model (e.g. ``model.transformer.h``)."""
    with torch.device("meta"):
        model = build(name, None)
    count = getattr(model.model.config, "num_hidden_layers", None)
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 and (count is None or len(module) == count):
            return path
    return ""

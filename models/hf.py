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


def fit_problems(name: str, overrides: dict[str, Any], info: Any) -> list[str]:
    """Why ``hf:<dir>``'s config (``config.json`` with ``overrides``) does not fit the data: its
    vocabulary or positions too small (read as JSON: no transformers import)."""
    import json

    with open(os.path.join(directory(name), "config.json")) as f:
        config = {**json.load(f), **overrides}
    found = []
    vocab = int(config.get("vocab_size") or 0)
    if vocab < info.num_classes:
        found.append(
            f"{name}: vocab_size {vocab} is smaller than the data's {info.num_classes} tokens; "
            f"set model.kwargs.vocab_size={info.num_classes}"
        )
    positions = config.get("max_position_embeddings") or config.get("n_positions")
    if positions and info.input_shape and int(positions) < info.input_shape[0]:
        found.append(
            f"{name}: {positions} positions, but the data's sequences are {info.input_shape[0]} long; "
            "shorten data.kwargs.seq_len or raise the model's positions"
        )
    return found


def kwargs_problems(name: str, overrides: dict[str, Any]) -> list[str]:
    """``model.kwargs`` that are not fields of ``hf:<dir>``'s config, one line each: ``transformers``
    would drop them without a word. Names in ``config.json`` pass without importing ``transformers``."""
    import difflib
    import json

    with open(os.path.join(directory(name), "config.json")) as f:
        written = json.load(f)
    unknown = [k for k in overrides if k not in written]
    if not unknown:
        return []
    config = _config(directory(name), {})
    fields = sorted(k for k in {*config.to_dict(), *getattr(config, "attribute_map", {})} if not k.startswith("_"))
    found = []
    for key in (k for k in unknown if not hasattr(config, k)):
        close = difflib.get_close_matches(key, fields, n=1)
        hint = f"did you mean model.kwargs.{close[0]}?" if close else f"its fields: {', '.join(fields[:12])}, ..."
        found.append(f"{name}: {key} is not a field of its {config.model_type} config; {hint}")
    return found


def _config(path: str, overrides: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False, **overrides)


def build(name: str, info: Any, **overrides: Any) -> nn.Module:
    """The causal LM of ``hf:<dir>`` (``overrides`` replace config fields), weights from its safetensors if any."""
    from transformers import AutoModelForCausalLM

    path = directory(name)
    config = _config(path, overrides)
    found = fit_problems(name, overrides, info) if info is not None else []
    if found:
        raise ValueError(found[0])
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

"""Checks made on the driver before Ray starts, for what a config needs but the machine may lack."""

from __future__ import annotations

import importlib.util
from typing import Any

# (config field, the value that needs it) -> (module to import, the pip requirement that brings it)
OPTIONAL_PACKAGES: dict[tuple[str, str], tuple[str, str]] = {
    ("tune.search", "optuna"): ("optuna", "optuna"),
    ("data.name", "parquet"): ("pyarrow", "pyarrow"),
    ("data.name", "csv"): ("pyarrow", "pyarrow"),
    ("data.name", "images"): ("PIL", "pillow"),
}


def _value(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def missing_packages(cfg: Any, fields: tuple[str, ...] = ("data.name", "tune.search")) -> list[str]:
    """One line per optional package that ``cfg`` needs (among ``fields``) and this Python cannot import."""
    problems = []
    for (field, value), (module, requirement) in OPTIONAL_PACKAGES.items():
        if field in fields and _value(cfg, field) == value and importlib.util.find_spec(module) is None:
            problems.append(
                f"{field}: {value} needs the package {requirement!r}, which is not installed; pip install {requirement}"
            )
    return problems

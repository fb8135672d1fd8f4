"""Arguments from a config typed as a function takes them: a bundled loader's or a model builder's.

A value of the wrong type or out of range failed inside the loader or the model's constructor
before, in every worker and often with torch's words (``width=abc``: "not all arguments converted
during string formatting"). Here it is a line that names the key and what it must be.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable
from typing import Any

Ranges = dict[str, tuple[float, float | None]]  # key -> (low, high): low <= value < high (high None: no bound)

_TYPE_WORDS = {float: "a number", int: "an integer", str: "a string", bool: "true or false"}


def type_words(hint: Any) -> str:
    """What a type hint asks for, in words: ``int | None`` -> "an integer or null"."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return f"{type_words(rest[0]) if len(rest) == 1 else hint} or null"
    return _TYPE_WORDS.get(hint, str(hint))


def plain_types(hint: Any) -> set[Any]:
    """The classes a hint admits at its top level (``int | Literal['auto'] | list[int]``: int, Literal, list)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return set().union(*(plain_types(a) for a in typing.get_args(hint)))
    return {typing.get_origin(hint) or hint}


def true_or_false_for_a_number(value: Any, hint: Any) -> bool:
    """Whether ``value`` is a YAML ``true``/``false`` given where ``hint`` asks for a number (pydantic
    would take it as 1 or 0)."""
    kinds = plain_types(hint)
    return isinstance(value, bool) and bool not in kinds and bool(kinds & {int, float})


def _adapter(hint: Any) -> Any:
    """pydantic's validator for ``hint``, refusing inf and NaN; a dataclass, TypedDict or model hint
    keeps its own config (pydantic refuses one given beside it)."""
    from pydantic import ConfigDict, PydanticUserError, TypeAdapter

    try:
        return TypeAdapter(hint, config=ConfigDict(allow_inf_nan=False))
    except PydanticUserError as exc:
        if exc.code != "type-adapter-config-unused":
            raise
        return TypeAdapter(hint)


def _hints(fn: Callable[..., Any]) -> dict[str, Any]:
    """``fn``'s parameter hints (a class's ``__init__``'s), each resolved on its own: one that names
    what its module cannot resolve is left out, not all of them."""
    target = inspect.unwrap(fn.__init__ if inspect.isclass(fn) else fn)
    namespace = getattr(target, "__globals__", {})
    hints = {}
    for key, hint in getattr(target, "__annotations__", {}).items():
        if isinstance(hint, str):  # `from __future__ import annotations`
            try:
                hint = eval(hint, namespace)  # noqa: S307 - what typing.get_type_hints does with it
            except Exception:  # noqa: BLE001
                continue
        hints[key] = hint
    return hints


def typed_kwargs(
    fn: Callable[..., Any], kwargs: dict[str, Any], ranges: Ranges
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """``kwargs`` converted to ``fn``'s type hints ("100" -> 100), and (key, problem) for each value of
    the wrong type or outside ``ranges``; keys ``fn`` does not take, and hints that are not plain
    data (a user's ``activation: nn.Module``, a name that cannot be resolved), are left alone."""
    from pydantic import PydanticUserError, ValidationError

    hints = _hints(fn)
    clean, problems = dict(kwargs), []
    for key, value in kwargs.items():
        if key not in hints:
            continue
        try:
            adapter = _adapter(hints[key])
        except (PydanticUserError, TypeError):  # not plain data to pydantic (typing.TypedDict before 3.12, too)
            continue
        try:
            if true_or_false_for_a_number(value, hints[key]):
                raise ValueError(value)
            clean[key] = adapter.validate_python(value)
        except (ValidationError, ValueError):
            problems.append((key, f"must be {type_words(hints[key])}, got {value!r}"))
            continue
        low, high = ranges.get(key, (None, None))
        v = clean[key]
        if low is not None and v is not None and not (low <= v and (high is None or v < high)):
            bound = f">= {low:g} and < {high:g}" if high is not None else f">= {low:g}"
            problems.append((key, f"must be {bound}, got {value!r}"))
    return clean, problems

"""Dataclass fields checked from their annotations, for configs.

The type hint gives the type (`X | None` also allows None), a `Literal` the choices, a
`Registry` in the field's metadata (`choice`) the functions it may name, and `bounded` the
numeric bounds. `check` raises ValueError naming the field and the rule it breaks. The
string under a field in the class body is its docstring (`docs`), which --help shows.

`parse` reads a value given as text (a command-line option, `diagnose --set`, `run -p`, an
arm's FIELD=VALUE) or as YAML gives it (a sweep's values) as the field's type: the one reader
of every entry point, with one rule for `none`. Where the field's choices (a `Literal` or a
registry) include `none`, the text `none` is that choice; elsewhere it is None for an
optional field (`X | None`) and the text itself for a string; a field's default is given by
leaving it out. A boolean is spelled true/false, yes/no, on/off or 1/0, in any case.
"""

from __future__ import annotations

import math
import re
import types
from dataclasses import field, fields
from functools import lru_cache
from typing import Literal, Union, get_args, get_origin, get_type_hints

from labkit.registry import Registry

_OPS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def bounded(default, **bounds: float):
    """A numeric field with bounds: `bounded(0.2, ge=0, lt=1)` (keys ge, gt, le, lt)."""
    assert set(bounds) <= set(_OPS), bounds
    return field(default=default, metadata=bounds)


def choice(default: str, registry: Registry):
    """A field naming a function of `registry`: a registered name or an import path."""
    return field(default=default, metadata={"registry": registry})


TRUE, FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")
"""The spellings of a boolean (any case) that `parse` accepts."""


def parse(value, hint, who: str, meta=None):
    """`value` as a field of type `hint` (and metadata `meta`): text is read by the module
    docstring's rules, a value that is already typed (YAML's, JSON's) is checked, an int
    becoming a float where a float is due. Only the type is checked here (bounds, choices and
    rules are the config's). ValueError starts with `who` ("--lr", "parameter lr of
    01.ipynb") and names the type and the value."""
    args = _args(hint)
    optional = type(None) in args
    kind = next((a for a in args if a is not type(None)), type(None))
    named = _named(kind, meta or {})
    base = str if named is not None else kind
    if not isinstance(value, str):
        return _typed(value, base, optional, who)
    text = value.strip()
    if text.lower() == "none":
        if named is not None and "none" in named:
            return "none"
        if optional:
            return None
    if base is str:
        return value
    if base is bool:
        if text.lower() in TRUE + FALSE:
            return text.lower() in TRUE
    elif base is int:
        if re.fullmatch(r"[-+]?\d+", text):
            return int(text)
    elif base is float:
        try:
            return float(text)
        except ValueError:
            pass
    raise ValueError(f"{who} must be {_kind_words(base, optional)}, got {value!r}")


@lru_cache(maxsize=None)
def type_hints(cls) -> dict:
    """`typing.get_type_hints(cls)`, evaluated once per class (it parses every annotation,
    and every config, command line and notebook parameter check asks for it); read-only."""
    return get_type_hints(cls)


def parse_field(cls, name: str, value, who: str | None = None):
    """`parse` for the field `name` of the dataclass `cls`; `who` defaults to `name`."""
    f = {f.name: f for f in fields(cls)}[name]
    return parse(value, type_hints(cls)[name], who or name, f.metadata)


def _named(kind, meta) -> tuple[str, ...] | None:
    """The names a choice field may take (a `Literal`'s, a registry's); None for another."""
    if get_origin(kind) is Literal:
        return get_args(kind)
    if "registry" in meta:
        return tuple(meta["registry"])
    return None


def _typed(value, base: type, optional: bool, who: str):
    """A value already of the field's type (a string for a string field or a choice)."""
    if value is None and optional:
        return None
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, base) and (base is bool or not isinstance(value, bool)):
        return value
    raise ValueError(f"{who} must be {_kind_words(base, optional)}, got {value!r} "
                     f"({type(value).__name__})")


def _kind_words(base: type, optional: bool) -> str:
    words = {bool: "bool (true or false; yes/no, on/off, 1/0)", int: "int", float: "float",
             str: "str"}.get(base, base.__name__)
    return words + (" or none" if optional else "")


def _args(hint) -> tuple:
    return get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)


def check(instance) -> None:
    """Every field of a dataclass instance against its annotation and metadata."""
    hints = type_hints(type(instance))
    for f in fields(instance):
        _check_field(f.name, getattr(instance, f.name), hints[f.name], f.metadata)


def _check_field(name: str, value, hint, meta) -> None:
    """One field against its annotation (`X | None` allows None; a `Literal`, bool, str, int
    or float) and its metadata (a registry, or bounds)."""
    args = _args(hint)
    optional = type(None) in args
    kind = next(a for a in args if a is not type(None))
    if value is None and optional:
        return
    or_none = " (or None)" if optional else ""
    if "registry" in meta:
        meta["registry"].resolve(value, name)
    elif get_origin(kind) is Literal:
        if value not in get_args(kind):
            raise ValueError(f"{name} must be one of {list(get_args(kind))}, got {value!r}")
    elif kind is bool:
        if not isinstance(value, bool):
            either = "True, False or None" if optional else "True or False"
            raise ValueError(f"{name} must be {either}, got {value!r}")
    elif kind is str:
        if not isinstance(value, str) or (optional and not value.strip()):
            what = "a non-empty string or None" if optional else "a string"
            raise ValueError(f"{name} must be {what}, got {value!r}")
    elif kind is int:
        if isinstance(value, bool) or not isinstance(value, int) or not _within(value, meta):
            raise ValueError(f"{name} must be an integer{_bounds(name, meta)}{or_none}, "
                             f"got {value!r}")
    elif isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number{or_none}, got {value!r}")
    elif not _within(value, meta):
        raise ValueError(f"{name} must be{_bounds(name, meta)}{or_none}, got {value!r}")


def _within(value, bounds) -> bool:
    tests = {"ge": value.__ge__, "gt": value.__gt__, "le": value.__le__, "lt": value.__lt__}
    return all(tests[key](bound) is True for key, bound in bounds.items() if key in tests)


def _bounds(name: str, bounds) -> str:
    """The bounds as words: ' >= 1', or ' in [0, 1) (0 <= eps_low < 1)' for two."""
    low = [(k, v) for k, v in bounds.items() if k in ("ge", "gt")]
    high = [(k, v) for k, v in bounds.items() if k in ("le", "lt")]
    if low and high:
        (lk, lo), (hk, hi) = low[0], high[0]
        interval = f"{'[' if lk == 'ge' else '('}{lo}, {hi}{']' if hk == 'le' else ')'}"
        return (f" in {interval} ({lo} {_OPS[lk].replace('>', '<')} {name} {_OPS[hk]} "
                f"{hi})")
    return "".join(f" {_OPS[k]} {v}" for k, v in low + high)


def choices(cls) -> dict[str, str]:
    """The choices of each `Literal` or registry field of `cls` for --help: a Literal's on one
    line, a registry's one per line."""
    hints, out = type_hints(cls), {}
    for f in fields(cls):
        if "registry" in f.metadata:
            out[f.name] = "\n" + f.metadata["registry"].describe("\n")
        elif get_origin(hints[f.name]) is Literal:
            out[f.name] = ", ".join(get_args(hints[f.name]))
    return out


def docs(cls) -> dict[str, str]:
    """Each field's docstring (the string under it in the class body), one line each, for the
    command line's --help; {} where the source cannot be read."""
    import ast
    import inspect

    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body, docs = tree.body[0].body, {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def base_types(cls) -> dict[str, type]:
    """The base type of each field (str for a choice, float for `float | None`), for the
    command line and the notebooks' parameter checks."""
    out = {}
    for name, hint in type_hints(cls).items():
        args = [a for a in get_args(hint) if a is not type(None)]
        if args and all(isinstance(a, str) for a in args):
            out[name] = str
        elif args:
            out[name] = args[0]
        else:
            out[name] = hint
    return out

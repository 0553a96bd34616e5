"""Registries for the variants the field keeps adding: a name -> one pure function.

verl's `register_adv_est` is the model. An advantage estimator, a loss aggregation mode or a
reward is one function decorated with its registry's `register(name)`, its paper in its
docstring; the config's choices, the command line's --help and the notebooks' parameter
checks all read the registry, so a new variant is one function, not five edits.

A user's own function is named by its import path, `package.module:function`; `resolve`
imports it and checks that it takes the registry's signature, with an error naming the
config field, when the config is made.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping


class Registry(Mapping):
    """Names -> functions of one signature: `params` positional, then `keywords`.

    A mapping (iterating gives the names in registration order); `register` adds one,
    `resolve` accepts a name or an import path.
    """

    def __init__(self, kind: str, params: tuple[str, ...], keywords: tuple[str, ...] = ()):
        self.kind, self.params, self.keywords = kind, params, keywords
        self._fns: dict[str, Callable] = {}

    def register(self, name: str, *, needs: tuple[str, ...] = (),
                 **attributes) -> Callable[[Callable], Callable]:
        """Decorator: `@ESTIMATORS.register("rloo")` adds the function under `name`, as is.

        needs: the optional inputs the function reads (an estimator's `("greedy_rewards",)`),
        stored on it as `fn.needs`, so the caller computes them only for the functions that
        read them. Other keywords are stored on the function as attributes of the same name
        (an aggregation mode's `normaliser`). A function registered by import path declares
        them the same way, as attributes."""
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"a {self.kind} name must be a non-empty string without ':', "
                             f"got {name!r}")

        def add(fn: Callable) -> Callable:
            if name in self._fns:
                raise ValueError(f"{self.kind} {name!r} is already registered "
                                 f"({self._fns[name].__module__}.{self._fns[name].__name__})")
            self._check_signature(fn, f"{self.kind} {name!r}")
            if needs:
                fn.needs = tuple(needs)
            for key, value in attributes.items():
                setattr(fn, key, value)
            self._fns[name] = fn
            return fn

        return add

    def resolve(self, name: str, field: str | None = None) -> Callable:
        """The function registered as `name`, or the one at the import path
        `package.module:function`. ValueError names `field` (else the kind) and the choices."""
        who = field or self.kind
        if isinstance(name, str) and name in self._fns:
            return self._fns[name]
        if not isinstance(name, str) or ":" not in name:
            raise ValueError(f"{who} must be one of {list(self)} or an import path "
                             f"'package.module:function', got {name!r}")
        module, _, attr = name.partition(":")
        try:
            fn = importlib.import_module(module)
            for part in attr.split("."):
                fn = getattr(fn, part)
        except Exception as e:  # noqa: BLE001 - a user's module may raise anything on import
            raise ValueError(f"{who}={name!r}: cannot import {attr!r} from {module!r} "
                             f"({type(e).__name__}: {e})") from None
        if not callable(fn):
            raise ValueError(f"{who}={name!r} is a {type(fn).__name__}, not a function")
        self._check_signature(fn, f"{who}={name!r}")
        return fn

    def _check_signature(self, fn: Callable, who: str) -> None:
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            return  # a builtin without a signature: its first call will tell
        try:
            signature.bind(*self.params, **dict.fromkeys(self.keywords))
        except TypeError as e:
            raise ValueError(f"{who} must accept the {self.kind} signature "
                             f"{self.signature()}: {e}") from None

    def signature(self) -> str:
        """The call every function here must accept, e.g. `(rewards, group_size, *, scale)`."""
        star = ("*, " + ", ".join(self.keywords),) if self.keywords else ()
        return f"({', '.join((*self.params, *star))})"

    def needs(self, name: str) -> tuple[str, ...]:
        """The optional inputs the function `name` (or import path) declares it reads."""
        return tuple(getattr(self.resolve(name), "needs", ()))

    def titles(self) -> dict[str, str]:
        """Each name -> its docstring's opening up to the first ': ' (by convention what it is
        and its paper, "Dr. GRPO (Liu et al., 2025): ...")."""
        def title(fn: Callable) -> str:
            doc = " ".join((inspect.getdoc(fn) or "").split("\n\n")[0].split())
            return doc.split(": ")[0] if ": " in doc else doc
        return {name: title(fn) for name, fn in self._fns.items()}

    def describe(self, sep: str = "; ") -> str:
        """Each name with its title (`titles`), joined by `sep`: one line for an error, or
        one line each for --help with sep="\n"."""
        return sep.join([f"{name}: {title}" if title else name
                         for name, title in self.titles().items()] +
                        ["or package.module:function"])

    def __getitem__(self, name: str) -> Callable:
        return self._fns[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fns)

    def __len__(self) -> int:
        return len(self._fns)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self)})"


__all__ = ["Registry"]

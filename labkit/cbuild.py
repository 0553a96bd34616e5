"""Where labkit finds a C compiler and keeps what it builds: the decode kernels
(`labkit.fast.kernels`) and the sandbox's jail (`labkit.sandbox.launch`), each compiled once
per machine on first use, with no build step at install."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def compiler() -> str | None:
    """`CC` when set, else the first of cc, gcc, clang on PATH; None without one."""
    named = os.environ.get("CC")
    if named:
        return shutil.which(named) or named
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    return None


def cache_root() -> Path:
    """~/.cache/labkit (XDG_CACHE_HOME/labkit where set): one folder per kind of build."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "labkit"

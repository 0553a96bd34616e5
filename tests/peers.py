"""The parity tests' peers beyond TRL (verl): imported, or the test skips when the peer is
not installed, unless LABKIT_REQUIRE_PEERS=1 (set by .ci/run), which turns a missing peer
into a failure, so CI never passes by skipping."""

from __future__ import annotations

import importlib
import os

import pytest


def peer(module: str):
    """The module `module` of a peer, or a skip (a failure under LABKIT_REQUIRE_PEERS=1)."""
    if os.environ.get("LABKIT_REQUIRE_PEERS") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module)

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def tiny():
    """The embedded model and tokenizer, loaded once per test session (CPU, fp32)."""
    from labkit.models import load

    return load(device="cpu")

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def tiny():
    """The embedded model and tokenizer, loaded once per test session (CPU, fp32)."""
    from labkit.model.models import load

    return load(device="cpu")


@pytest.fixture(scope="session")
def random_qwen(tiny):
    """A randomly initialised Qwen2 with the embedded tokenizer: another architecture, and a
    broad next-token distribution (it rarely says EOS, so rows get truncated)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    _, tokenizer = tiny
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config).eval(), tokenizer


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` skip, saying why, where torch sees no CUDA device."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (scripts/gpu_check.sh runs these)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)

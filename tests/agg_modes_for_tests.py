"""Aggregation modes given by import path, for tests/test_trainer.py."""


def twice_token_mean(masked, mask, *, max_len=None):
    """A token-normalised mode that is not token-mean: twice the token mean."""
    return 2 * masked.sum() / mask.sum().clamp(min=1)


twice_token_mean.normaliser = "tokens"


def undeclared(masked, mask, *, max_len=None):
    """A mode that does not say what it divides by."""
    return masked.sum() / mask.sum().clamp(min=1)

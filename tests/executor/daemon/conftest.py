import pytest


@pytest.fixture(scope="module")
def model(checkpoint):
    """The daemon tests' checkpoint: tiny Qwen3, fp32 (exact against the offline engine)."""
    return checkpoint("qwen3", "fp32")

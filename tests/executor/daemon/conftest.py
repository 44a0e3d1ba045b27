import pytest

from executor.server.client import ExecutorClient


@pytest.fixture(scope="module")
def model(checkpoint):
    """The daemon tests' checkpoint: tiny Qwen3, fp32 (exact against the offline engine)."""
    return checkpoint("qwen3", "fp32")


@pytest.fixture(scope="module")
def client(daemon):
    """A client of the module's `daemon` fixture (modules that serve one define it)."""
    with ExecutorClient(daemon.addr) as c:
        yield c

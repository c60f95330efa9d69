import pytest

from tests.support.cluster import Processes


@pytest.fixture
def procs(tmp_path):
    """Owner of every process a test starts; stops them all, even when the test fails."""
    owner = Processes(tmp_path)
    try:
        yield owner
    finally:
        owner.stop_all()


@pytest.fixture
def cleanup():
    """Registers ``rpcps up`` processes (``tests.support.upcli.UpProcess``); kills each and every
    role it started, even when the test fails."""
    started = []
    yield started.append
    for up in started:
        up.kill()

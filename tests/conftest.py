import pytest

from tests.support.cluster import Processes

# Modules whose tests make hosts (network namespaces, CPU groups) or run daemons (Slurm, podman):
# one worker runs them one after another, first, while the other runs the rest. Most of their time
# is spent waiting on a deadline of Slurm's, a lease or an engine (about one core busy of two).
HOSTS = frozenset({"test_compose_engine", "test_compose_hosts", "test_emulated_hosts", "test_partitions",
                   "test_slurm"})


@pytest.hookimpl(tryfirst=True)     # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each module's tests in one worker (they share its cluster or daemon start-ups), the hosts'
    modules in one group for them all, ahead of the rest."""
    def group(item: pytest.Item) -> str:
        module = item.path.stem
        return "hosts" if module in HOSTS and item.path.parent.name == "integration" else module
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group(item)))
    items.sort(key=lambda item: group(item) != "hosts")


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

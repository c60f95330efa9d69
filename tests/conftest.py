from pathlib import Path
from typing import Any

import pytest

from tests.support.cluster import Processes

# Modules whose tests make hosts (network namespaces, CPU groups) or run daemons (Slurm, podman):
# one worker runs them one after another, first, while the other runs the rest. Most of their time
# is spent waiting on a deadline of Slurm's, a lease or an engine (about one core busy of two).
HOSTS = frozenset({"test_compose_engine", "test_compose_hosts", "test_emulated_hosts", "test_partitions",
                   "test_slurm"})


def group_of(nodeid: str) -> str:
    """The work unit of the test ``nodeid``: its module's file, or ``hosts`` for the modules above."""
    path = nodeid.split("::", 1)[0]
    file = Path(path)
    return "hosts" if file.stem in HOSTS and file.parent.name == "integration" else path


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The hosts' modules ahead of the rest: the longest unit of work starts first."""
    items.sort(key=lambda item: group_of(item.nodeid) != "hosts")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's workers (``-n``) take whole units of work (``group_of``): a module's tests
    share its cluster or daemon start-ups."""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)
    return ByModule(config, log)


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

"""The one RPC mechanism's callee side, in process: what a caller's request turns into."""
from __future__ import annotations

import abc
from typing import Any, Optional

import pytest
import torch

from services import remote
from services.errors import BadRequest, InternalError, NotReady, StepLost, Superseded
from services.remote import Service, _invoke, remote_methods


class Counter(Service, abc.ABC):
    """A surface whose implementation lives in a subclass, as the roles' do."""

    @remote.remote
    @abc.abstractmethod
    def add(self, amount: int, note: Optional[str] = None) -> int: ...

    @remote.remote
    def scale(self, values: list[float], by: float) -> list[float]:
        return [v * by for v in values]

    @remote.remote
    def rows(self, ids: torch.Tensor) -> int:
        return ids.numel()

    @remote.remote
    def broken(self) -> None:
        return {}["missing"]

    @remote.remote
    def apply(self, name: str, *args: Any) -> tuple:
        return (name, *args)

    def not_remote(self) -> str:
        return "must never run for a caller"


class CounterImpl(Counter):
    def __init__(self) -> None:
        self.total = 0
        self.calls: list[tuple] = []

    def add(self, amount: int, note: Optional[str] = None) -> int:
        self.total += amount
        return self.total

    def before_call(self, caller: str, method: str, version: int = 0) -> None:
        self.calls.append(("before", caller, method))

    def after_call(self, method: str, seconds: float, ok: bool) -> None:
        self.calls.append(("after", method, ok))

    def superseded(self, caller: str, method: str) -> None:
        self.calls.append(("superseded", caller, method))


@pytest.fixture(autouse=True)
def group(monkeypatch):
    """The group as the callee sees it: each member of rank 1, but trainer9, whose rank 1 was
    replaced by rank 4."""
    monkeypatch.setattr(remote, "_current", lambda caller, rank: rank == (4 if caller == "trainer9" else 1))


@pytest.fixture
def served():
    impl = CounterImpl()
    remote.serve(impl)
    try:
        yield impl
    finally:
        remote.withdraw(impl)


def test_a_call_names_the_surface_method_and_runs_the_served_override(served):
    assert _invoke(Counter.add, "trainer0", 1, 2) == 2
    assert _invoke(Counter.add, "trainer1", 1, 3, "note") == 5
    assert served.calls[:2] == [("before", "trainer0", "add"), ("after", "add", True)]
    assert remote_methods(Counter) == ["add", "scale", "rows", "broken", "apply"]
    assert _invoke(Counter.apply, "t", 1, "decode", 1, [2]) == ("decode", 1, [2])      # *args pass through


@pytest.mark.parametrize("args, says", [
    ((), "missing a required argument"),
    ((1, "a", "b"), "too many positional arguments"),
    ((True,), "amount: Input should be a valid integer"),
    (("3",), "amount: Input should be a valid integer"),
    ((1, 7), "note: Input should be a valid string"),
])
def test_arguments_that_do_not_fit_the_signature_are_the_callers_bad_request(served, args, says):
    with pytest.raises(BadRequest, match=says):
        _invoke(Counter.add, "trainer0", 1, *args)
    assert served.total == 0
    assert served.calls[-1] == ("after", "add", False)   # counted as a failed request


def test_nested_and_tensor_arguments_are_checked_too(served):
    assert _invoke(Counter.scale, "t", 1, [1, 2.5], 2) == [2.0, 5.0]
    with pytest.raises(BadRequest, match=r"values\[1\]: Input should be a valid number"):
        _invoke(Counter.scale, "t", 1, [1.0, "x"], 2.0)
    assert _invoke(Counter.rows, "t", 1, torch.arange(4)) == 4
    with pytest.raises(BadRequest, match="ids: Input should be an instance of Tensor, got list"):
        _invoke(Counter.rows, "t", 1, [0, 1])


def test_a_bug_inside_a_method_is_an_internal_error_not_the_callers_fault(served, caplog):
    with pytest.raises(InternalError, match="Counter.broken failed: KeyError"):
        _invoke(Counter.broken, "trainer0", 1)
    assert "Counter.broken failed on a request from trainer0" in caplog.text
    assert "Traceback" in caplog.text


def test_only_remote_methods_can_be_called(served):
    with pytest.raises(BadRequest, match="not a remote method"):
        _invoke(Counter.not_remote, "trainer0", 1)
    with pytest.raises(BadRequest, match="not a remote method"):
        _invoke(print, "trainer0", 1, "hello")


def test_a_service_not_served_here_is_not_ready():
    with pytest.raises(NotReady, match="serves no Counter"):
        _invoke(Counter.add, "trainer0", 1, 1)


def test_withdrawn_services_are_gone_and_others_stay():
    first, second = CounterImpl(), CounterImpl()
    remote.serve(first)
    remote.serve(second)           # the newest serves
    try:
        assert _invoke(Counter.add, "t", 1, 1) == 1 and second.total == 1 and first.total == 0
        remote.withdraw(first)     # not the one serving: nothing changes
        assert _invoke(Counter.add, "t", 1, 1) == 2
    finally:
        remote.withdraw(second)
    with pytest.raises(NotReady):
        _invoke(Counter.add, "t", 1, 1)


def test_a_request_of_an_old_incarnation_is_refused_whole_and_counted(served):
    with pytest.raises(Superseded, match="add from trainer9 of rank 1 refused: no longer a member of that name"):
        _invoke(Counter.add, "trainer9", 1, 5)
    assert served.total == 0 and served.calls == [("superseded", "trainer9", "add")]
    assert _invoke(Counter.add, "trainer9", 4, 5) == 5          # its replacement is served
    assert isinstance(Superseded("x"), StepLost), "a trainer loses the step, and goes on or leaves"

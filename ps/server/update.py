"""The update rule: how a server applies trainers' gradients to its parameters.

One optimizer per server process is shared by every trainer, under the lock that also orders
parameter reads. The job's consistency (``ps/spec/consistency.py``) decides what reaches it:

* async and ssp:K: each trainer's step as it arrives (``ParameterServer.apply`` in ``ps/server/service.py``,
  with the gradients distributed autograd left in the trainer's context); ssp's bound is the step
  clock's (``ps/leader/clock/``), which only decides when a trainer may read;
* sync: each trainer hands its step's gradients over (``SyncSteps.contribute``); when the leader's
  step clock closes the step, every server averages the arrived trainers' gradients, scales them
  by the clip factor computed from the average's global norm, and applies them as one update.

The trainer's side of a step (backward, clipping, the hand-over) is ``ps/client/session.py``'s ``StepSession``."""
from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from typing import Any, Callable, Iterator, Mapping, Optional, TypeVar

import torch

from ps.server.marks import AppliedMarks
from ps.spec.messages import Mark
from ps.spec.rules import RuleOptimizer, UpdateRule, grad_sq_norm
from services.errors import BadRequest

T = TypeVar("T")


def average(grads: list[torch.Tensor], n: int) -> torch.Tensor:
    """The mean over ``n`` trainers of one parameter's gradients, ``grads`` those that gave one (a
    trainer whose batch did not touch a shard's rows gave none: zero). Sparse ones stay sparse."""
    total = functools.reduce(torch.add, grads)
    return total.coalesce() * (1.0 / n) if total.is_sparse else total.div_(n)


class SyncSteps:
    """sync mode on one server: each trainer's gradients for the open step, until the leader's
    step clock closes the step and names whose gradients count."""

    def __init__(self, optimizer: "SharedOptimizer") -> None:
        self.optimizer = optimizer
        self._lock = threading.Lock()
        self._given: dict[str, dict[torch.Tensor, torch.Tensor]] = {}   # trainer -> its gradients
        self._marks: dict[str, Mark] = {}
        self._average: Optional[tuple[int, tuple[str, ...], dict[torch.Tensor, torch.Tensor]]] = None

    def contribute(self, step: int, trainer: str, grads: dict[torch.Tensor, torch.Tensor],
                   mark: Optional[Mark] = None) -> None:
        self._check_open(step)
        with self._lock:
            self._given[trainer] = grads     # a retried hand-over replaces the first
            if mark is not None:
                self._marks[trainer] = mark

    def sq_norm(self, step: int, trainers: tuple[str, ...]) -> float:
        """The squared norm of this server's share of the step's averaged gradient."""
        return grad_sq_norm(list(self._averaged(step, trainers).values()))

    def apply(self, step: int, trainers: tuple[str, ...], coef: float) -> None:
        grads = self._averaged(step, trainers)
        if coef < 1.0:
            for g in grads.values():
                g.mul_(coef)
        with self._lock:
            marks = {t: self._marks[t] for t in trainers if t in self._marks}
        self.optimizer.apply(grads, marks=marks)
        with self._lock:
            self._given.clear()       # a dead trainer's partial hand-over goes with the step
            self._marks.clear()
            self._average = None

    def _check_open(self, step: int) -> None:
        if step != self.optimizer.steps + 1:
            raise BadRequest(f"step {step} is not open on this server: it has applied {self.optimizer.steps} "
                             f"steps, so the open one is {self.optimizer.steps + 1}")

    def _averaged(self, step: int, trainers: tuple[str, ...]) -> dict[torch.Tensor, torch.Tensor]:
        self._check_open(step)
        with self._lock:
            if self._average is not None and self._average[:2] == (step, trainers):
                return self._average[2]
            missing = [t for t in trainers if t not in self._given]
            if missing or not trainers:
                raise BadRequest(f"step {step}: no gradients from {', '.join(missing) or 'any trainer'} on this server")
            given = [self._given[t] for t in trainers]
            params = {p: None for g in given for p in g}
            averaged = {p: average([g[p] for g in given if p in g], len(given)) for p in params}
            self._average = (step, trainers, averaged)
            return averaged


class SharedOptimizer:
    """The server's optimizer and the lock that orders its steps against parameter reads."""

    def __init__(self, params: list[torch.nn.Parameter], rules: list[UpdateRule], lr: float,
                 on_step: Optional[Callable[[int, float], None]] = None,
                 touched: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None) -> None:
        """``rules``: each parameter's update rule (a table's may differ from the dense ones');
        ``on_step(rows, seconds)`` after each step: table rows it changed, seconds it took;
        ``touched(param, grad)`` for each parameter a step changes, under the lock."""
        self.lock = threading.Lock()
        self.params = params
        self.optimizer = RuleOptimizer(list(zip(params, rules)), lr)
        self._on_step, self._touched = on_step, touched
        self.steps = 0  # updates applied: the cluster's step, the same on every server at a pause
        self.marks = AppliedMarks()     # which trainers' batches the parameters hold (``ps/server/marks.py``)

    def apply(self, grads: dict[torch.Tensor, torch.Tensor],
              keep: Optional[Callable[[dict], dict]] = None, then: Optional[Callable[[], T]] = None,
              marks: Optional[Mapping[str, Mark]] = None) -> tuple[int, Optional[T]]:
        """Apply ``grads`` (parameter -> gradient; parameters left out are not updated), as
        ``keep(grads)`` leaves them, under the lock, and record whose batches they are (``marks``);
        none of it if every mark is of a batch applied here before. The number of updates applied
        before this one, and what ``then()`` read under the same lock: the parameters as this
        update left them, before another's."""
        with self.lock:
            before = self.steps
            fresh = {t: m for t, m in (marks or {}).items() if self.marks.fresh(t, m)}
            if marks and not fresh:
                self.marks.repeat()
                return before, then() if then is not None else None
            started = time.perf_counter()
            if keep is not None:
                grads = keep(grads)
            rows = self._step(grads)
            self.marks.record(fresh)
            seconds = time.perf_counter() - started
            after = then() if then is not None else None
        if self._on_step is not None:
            self._on_step(rows, seconds)
        return before, after

    def advance_to(self, steps: int) -> int:
        """Count on from ``steps`` if the cluster has come further than this server (never back)."""
        with self.lock:
            self.steps = max(self.steps, steps)
            return self.steps

    def _step(self, grads: dict[torch.Tensor, torch.Tensor]) -> int:
        rows = sum(g._nnz() for g in (grads.get(p) for p in self.params) if g is not None and g.is_sparse)
        if self._touched is not None:
            for p in self.params:
                if p in grads:
                    self._touched(p, grads[p])
        self.optimizer.step(grads)
        self.steps += 1
        return rows

    def clear_rows(self, param: torch.Tensor, rows: torch.Tensor) -> None:
        """Zero ``param``'s optimizer state of ``rows`` (a hashed table's rows handed to new ids).
        Under ``lock``."""
        state = self.optimizer.state.get(param, {})
        for key in self.optimizer.rule_of(param).row_state:
            if key in state:
                state[key][rows] = 0

    def state_of(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """Copies of ``param``'s optimizer state (empty before its first step, and for SGD). Under ``lock``."""
        return {k: v.clone() for k, v in self.optimizer.state.get(param, {}).items()}

    def live_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """``param``'s optimizer state itself, not a copy (to copy a part of). Under ``lock``."""
        return self.optimizer.state.get(param, {})

    def set_state(self, param: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """``param``'s optimizer state from elsewhere (checked by the caller). Under ``lock``."""
        self.optimizer.state[param] = state

    def snapshot(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Consistent copies: never half-way through another trainer's update."""
        with self.lock:
            return [t.detach().clone() for t in tensors]

    def copy_buffers(self) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
        """Empty tensors shaped like the parameters and their state, their pages already touched.

        A fresh gigabyte costs its page faults on first write; taking them here, before the trainers
        are held, leaves only a memory copy for ``state_copy``.
        """
        with all_cores():
            params = [torch.empty_like(p).zero_() for p in self.params]
            state = [{k: torch.empty_like(v).zero_() for k, v in self.optimizer.state.get(p, {}).items()
                      if isinstance(v, torch.Tensor)} for p in self.params]
        return params, state

    def state_copy(self, into: Optional[tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]] = None
                   ) -> tuple[int, list[torch.Tensor], list[dict[str, torch.Tensor]]]:
        """(steps, parameters, per-parameter optimizer state), all private copies, taken at once
        (into ``into`` from ``copy_buffers`` when given)."""
        buffers = into if into is not None else self.copy_buffers()
        with self.lock, all_cores():
            for dst, p in zip(buffers[0], self.params):
                dst.copy_(p.detach())
            for dst, p in zip(buffers[1], self.params):
                for k, v in self.optimizer.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor):
                        if k not in dst or dst[k].shape != v.shape:
                            dst[k] = torch.empty_like(v)  # state that appeared since the buffers were made
                        dst[k].copy_(v)
            return self.steps, buffers[0], buffers[1]

    def load_state(self, steps: int, state: list[dict[str, torch.Tensor]],
                   marks: Optional[Mapping[str, dict]] = None) -> None:
        """Adopt (not copy) restored per-parameter state, and the marks saved with it."""
        with self.lock:
            self.steps = steps
            self.marks = AppliedMarks(marks)
            for p, s in zip(self.params, state):
                if s:
                    self.optimizer.state[p] = dict(s)


# torch's thread count is the process's: copies on several RPC threads at once (a source handing
# parts to two destinations) raise it once and put it back when the last is done, so none restores a
# count another raised. Guarded by its lock.
_CORES_LOCK = threading.Lock()
_cores = {"inside": 0, "before": 1}


@contextlib.contextmanager
def all_cores() -> Iterator[None]:
    """Copy with every core: a checkpoint's snapshot (and a change of layout's copies and rebuild)
    runs while the trainers are held, so the cores are otherwise idle, and a fresh copy's cost is
    page faults, which cores take in parallel."""
    with _CORES_LOCK:
        if _cores["inside"] == 0:
            _cores["before"] = torch.get_num_threads()
            torch.set_num_threads(os.cpu_count() or _cores["before"])
        _cores["inside"] += 1
    try:
        yield
    finally:
        with _CORES_LOCK:
            _cores["inside"] -= 1
            if _cores["inside"] == 0:
                torch.set_num_threads(_cores["before"])


BACKGROUND_NICE = 10        # how much less a copy made while training goes on weighs than a request


def _nicer() -> None:
    """This thread ``BACKGROUND_NICE`` steps nicer (Linux gives each thread its own priority)."""
    try:
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me, min(19, os.getpriority(os.PRIO_PROCESS, me) + BACKGROUND_NICE))
    except (AttributeError, OSError):        # not Linux, or not allowed: at the caller's priority
        pass


def in_background(work: Callable[[], T]) -> T:
    """``work`` on a nicer thread of its own, and its result or what it raised: a change of
    layout's copies while training goes on take the cores that the trainers and the requests
    leave idle, instead of a share of them."""
    out: dict[str, Any] = {}

    def run() -> None:
        _nicer()
        try:
            out["value"] = work()
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            out["error"] = exc
    thread = threading.Thread(target=run, name="in-background", daemon=True)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def release_later(*holders: Any) -> None:
    """Let go of the tensors in ``holders`` (dicts, lists and tuples of them) one at a time on a
    nicer thread: a rebuilt shard's old gigabytes, freed after the hold instead of in it (freeing
    them at once was half of a rebuild's held time at Criteo's full size)."""
    tensors: list[torch.Tensor] = []
    stack = list(holders)
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            tensors.append(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)

    def drop() -> None:
        _nicer()
        while tensors:
            tensors.pop()       # one tensor's pages at a time, so that the GIL passes between them
    threading.Thread(target=drop, name="release", daemon=True).start()

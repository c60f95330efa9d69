"""A marked batch whose step was lost on its way is trained again under the same mark
(``TrainLoop``, over a fake client and task): a server that applied it before the loss answers
the repeat without applying it (``ps/server/marks.py``), and none misses it. A refused one (its
gradients not finite) is skipped: the data is what is wrong."""
import contextlib
import time
from types import SimpleNamespace

import pytest
import torch

from services.errors import ServerLost, UpdateRefused
from trainer.core.loop import TrainLoop


class Task:
    unit, exactly_once = "samples", True

    def __init__(self):
        self.cursor = 0

    def next_batch(self):
        self.cursor += 1
        return self.cursor - 1

    def position(self, steps):
        return {"steps": steps, "record": self.cursor}

    def fetch(self, batch):
        return None

    def loss(self, batch, fetched):
        return torch.tensor(float(batch))

    def units(self, batch):
        return 10

    def stepped(self):
        pass


def loop_failing(*failures):
    """A loop whose steps' ``finish`` raise ``failures`` in turn (None: it applies); the marks
    that reached ``finish``, in order."""
    marks, left = [], list(failures)

    def finish(loss, clip, replica, weights, mark):
        marks.append(mark)
        failure = left.pop(0) if left else None
        if failure is not None:
            raise failure
        return SimpleNamespace(grad_norm=0.0, backward=0.0, backward_cpu=0.0, clip=0.0, optimize=0.0, barrier=0.0,
                               arrived_at=0.0, weights=None)
    client = SimpleNamespace(clock=SimpleNamespace(begin=lambda: 0.0, ahead=0), cache=None,
                             consistency=SimpleNamespace(averaged=False),
                             read_ahead=lambda early, cache: None, traffic=SimpleNamespace(total=0, calls=0),
                             losses=SimpleNamespace(failed=lambda exc, replica: None),
                             step=lambda: contextlib.nullcontext(SimpleNamespace(finish=finish)))
    task = Task()
    task.model = SimpleNamespace(client=client, replica=None, allreduce_bytes=0, follow_group=lambda: None,
                                 train=lambda: None)
    return TrainLoop(task, clip=0.0), marks


def test_a_lost_step_trains_its_batch_again_under_the_same_mark_and_a_refused_one_is_skipped():
    loop, marks = loop_failing(ServerLost("ps1 went away", ("ps1",)), None, UpdateRefused("not finite"), None)
    with pytest.raises(ServerLost):
        loop.step(1)
    loop.step(1)                    # the runner's steps did not move: the same number
    with pytest.raises(UpdateRefused):
        loop.step(2)
    loop.step(2)
    assert [(m.steps, m.position["record"]) for m in marks] == [(1, 1), (1, 1), (2, 2), (2, 3)]
    assert marks[0] is marks[1], "the lost batch again, with its own mark"


def test_unmarked_steps_take_the_next_batch_after_a_loss():
    loop, marks = loop_failing(ServerLost("ps1 went away", ("ps1",)))
    with pytest.raises(ServerLost):
        loop.step()
    loop.step()
    assert marks == [None, None] and loop.task.cursor == 2


def _spend(seconds: float) -> None:
    """Keeps this thread on the CPU for ``seconds`` of its own CPU time."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


def test_a_steps_cpu_is_told_by_phase_and_the_backwards_comes_from_its_finish():
    loop, _ = loop_failing()
    loop.task.loss = lambda batch, fetched: (_spend(0.03), torch.tensor(1.0))[1]
    finish = loop.model.client.step().__enter__().finish

    def finish_spending(*args, **kwargs):
        _spend(0.025)                   # a backward of 0.01 of it, then the update
        return SimpleNamespace(**{**vars(finish(*args, **kwargs)), "backward_cpu": 0.01})
    loop.model.client.step = lambda: contextlib.nullcontext(SimpleNamespace(finish=finish_spending))
    cpu = loop.step().cpu
    assert set(cpu) == {"batch", "fetch", "forward", "backward", "update", "total"}, cpu
    assert 0.03 <= cpu["forward"] < 0.2 and cpu["backward"] == 0.01 and 0.01 <= cpu["update"] < 0.2, cpu
    parts = sum(v for k, v in cpu.items() if k != "total")
    assert abs(cpu["total"] - parts) < 1e-9 and cpu["total"] >= 0.05, cpu

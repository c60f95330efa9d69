"""One member of a gloo group summing with ``trainer.core.allreduce.GroupSum``, run as its own
process by tests/integration/test_dense_group.py:
``python -m tests.support.sum_member ROLE RANK WORLD PORT FLOATS``.

A ``summer`` sums its own tensor (drawn from a stream seeded by its rank, so any member can draw
every member's) and prints, as JSON, a digest of the sum's bits, its largest difference from the
sum taken in float64 of every member's tensor, and how long it waited; on a failure it leaves the
group as a trainer does (``DenseReplica.leave_group``) and prints the error instead. A ``leaver``
leaves the group at once, without summing; a member that ``dies`` is killed (SIGKILL)."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _abort_process_group

# As a trainer has it (trainer/core/replica.py): without torch._dynamo imported, an aborted
# group's peers wait on to the timeout.
import torch._dynamo  # noqa: E402,F401
from trainer.core.allreduce import GroupSum

GROUP_TIMEOUT = 60.0


def drawn(rank: int, floats: int) -> torch.Tensor:
    return torch.randn(floats, generator=torch.Generator().manual_seed(rank))


def main() -> None:
    role, rank, world, port, floats = sys.argv[1], *map(int, sys.argv[2:6])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=GROUP_TIMEOUT))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=GROUP_TIMEOUT))
    # Every member in the group before any leaves or dies: one gone while another is still
    # connecting fails that one's join, not the sum the test is about (seen on a busy machine).
    store.set(f"joined{rank}", "1")
    store.wait([f"joined{r}" for r in range(world)])
    if role == "dies":
        store.wait(["ready"])
        os.kill(os.getpid(), signal.SIGKILL)
    if role == "leaver":
        store.wait(["ready"])
        _abort_process_group()
        print(json.dumps({"left": True}), flush=True)
    else:
        mine = drawn(rank, floats)
        exact = sum(drawn(r, floats).double() for r in range(world))
        store.wait(["ready"])
        t0 = time.monotonic()
        try:
            total = GroupSum(saved_at_least=1).start(mine).wait()     # halving and doubling from 3
        except Exception as exc:  # noqa: BLE001 - what the test looks at
            _abort_process_group()
            print(json.dumps({"error": str(exc).splitlines()[0], "waited": time.monotonic() - t0}), flush=True)
        else:
            print(json.dumps({"digest": hashlib.sha256(total.numpy().tobytes()).hexdigest(),
                              "error_max": float((total.double() - exact).abs().max()),
                              "waited": time.monotonic() - t0}), flush=True)
    store.wait(["done"])


if __name__ == "__main__":
    main()
    os._exit(0)     # as a role ends: an aborted group's threads can abort a normal teardown

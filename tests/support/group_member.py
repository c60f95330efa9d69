"""One trainer's replica in a process group of two, run as its own process by
tests/integration/test_dense_group.py: ``python -m tests.support.group_member ROLE RANK PORT``.

Both form the group as a trainer does (``DenseReplica.follow``) at the test's store. Then the
``waiter`` announces itself and all-reduces, while the ``leaver`` leaves the group as a trainer
does after a collective failed on its side, without entering the all-reduce. The waiter prints,
as JSON, what its all-reduce gave and how long it waited."""
from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from ps.spec.messages import Granted
from trainer.core.replica import DenseReplica
from trainer.lm.config import LmModelConfig
from trainer.lm.model import _Body, init_lstm_layer

GROUP_TIMEOUT = 60.0
MEMBERS = ("trainer0", "trainer1")


def main() -> None:
    role, rank, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=GROUP_TIMEOUT))
    config = LmModelConfig(ntoken=10, emsize=4, nhid=4, nlayers=1)
    replica = DenseReplica(MEMBERS[rank], _Body(config, 0.0).lstm, config.optimizer, config.lr,
                           init_lstm_layer(config, 0), lambda key: dist.PrefixStore(key, store), GROUP_TIMEOUT)
    replica.follow(Granted(0, MEMBERS, "test/1"))
    if role == "waiter":
        store.set("waiting", "1")
        t0 = time.monotonic()
        total = replica.sum_over_group([1.0], timeout=GROUP_TIMEOUT)
        print(json.dumps({"total": total, "waited": time.monotonic() - t0}), flush=True)
    else:
        store.wait(["waiting"])
        replica.leave_group()
        print(json.dumps({"in_group": dist.is_initialized()}), flush=True)
        store.wait(["done"])    # alive, as a trainer that lost its step is, until the test ends


if __name__ == "__main__":
    main()
    # As a role ends (services/runtime.py): torch's threads, an aborted group's among them, can
    # abort an interpreter's normal teardown.
    os._exit(0)

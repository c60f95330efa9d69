"""``rpcps bench checkpoint``: one server shard's checkpoint save and restore, against ``dd``.

The shard holds one ROWS x DIM table with Adagrad state (a ParameterServer built in this process
from a one-table ``ModelSpec``; checkpoints do not need RPC to be measured). Reported: save and restore MB/s next to what
``dd`` with fsync writes and reads on the same disk in the same run, the time training would be
paused (the in-memory snapshot), and the peak extra resident memory while saving.

A shared disk's speed swings by 2x within seconds, so the restore is measured in rounds, each right
after ``dd`` reads the checkpoint file itself (page cache dropped before both where allowed), and
the ratio reported is the median of the rounds' ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

TARGETS = {"save_vs_dd": 0.5, "restore_vs_dd": 0.5, "pause_vs_save": 0.10, "extra_memory_vs_shard": 1.2}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="JSON only (the output is JSON either way)")
    p.add_argument("--rows", type=int, default=2_000_000, help="embedding rows in the shard")
    p.add_argument("--dim", type=int, default=64, help="embedding width")
    p.add_argument("--rounds", type=int, default=5, help="restore rounds, each paired with a dd read")
    p.add_argument("--dir", type=Path, default=Path("."), help="a folder on the disk to measure (a temporary "
                                                                 "subfolder is created and removed)")


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class _PeakRss:
    def __init__(self) -> None:
        self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __enter__(self) -> "_PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _drop_caches() -> bool:
    """Empty the page cache so reads come from the disk (needs root); False where not allowed."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


_BLOCK = 4 << 20


def _dd_write(tmp: Path, nbytes: int) -> float:
    """MB/s of dd writing a file as large as the checkpoint, with fsync."""
    path, count = tmp / "dd.bin", max(1, nbytes // _BLOCK)
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", f"bs={_BLOCK}", f"count={count}", "conv=fsync"],
                   check=True, capture_output=True)
    write = count * _BLOCK / (time.perf_counter() - t0) / 1e6
    path.unlink()
    return write


def _dd_read(path: Path, cold: bool) -> float:
    """MB/s of dd reading ``path``."""
    if cold:
        _drop_caches()
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={_BLOCK}"], check=True, capture_output=True)
    return path.stat().st_size / (time.perf_counter() - t0) / 1e6


def _server(rows: int, dim: int, restore=None):
    """One shard of a one-table model with live Adagrad state (after one sparse update, as in training)."""
    import torch
    from prometheus_client import CollectorRegistry

    from ps.server.metrics import PsMetrics
    from ps.server.service import ParameterServer
    from ps.spec.model import ModelSpec, Table

    g = torch.Generator().manual_seed(0)
    spec = ModelSpec({"rows": Table(rows, {"rows.weight": (dim,)},
                                    lambda ids: {"rows.weight": torch.rand(len(ids), dim, generator=g)})},
                     optimizer="adagrad", lr=0.1, meta={"rows": rows, "dim": dim}, compatible=("rows", "dim"))
    server = ParameterServer("ps0", 0, 1, spec, PsMetrics(CollectorRegistry(), "ps", "ps0"), restore=restore)
    if restore is None:
        ids = torch.randint(0, rows, (8192,))
        weight = server.param("rows.weight")
        server.optimizer.apply({weight: torch.sparse_coo_tensor(ids.unsqueeze(0), torch.ones(8192, dim),
                                                                (rows, dim), check_invariants=True)})
    return server


def _bytes(server) -> int:
    import torch
    state = server.optimizer.optimizer.state.values()
    return (sum(p.numel() * p.element_size() for p in server.optimizer.params)
            + sum(v.numel() * v.element_size() for s in state for v in s.values() if isinstance(v, torch.Tensor)))


def _save(server, store) -> dict:
    """A checkpoint's save as a server makes it: buffers prepared, the copy (the pause), the write."""
    before = _rss()
    with _PeakRss() as rss:
        t_prepare = time.perf_counter()
        buffers = server.optimizer.copy_buffers()   # before the trainers are held
        t0 = time.perf_counter()
        state = server.export_state(into=buffers)   # while they are held at a step boundary
        t1 = time.perf_counter()
        store.prepare(1)
        entry = store.write_file(1, "ps0.pt", state)
        store.commit(1, [entry], {"num_ps": 1, "model": server.spec.meta})
        t2 = time.perf_counter()
    del state, buffers  # as a server does once the file is written
    return {"save_s": t2 - t_prepare, "pause_s": t1 - t0, "file_bytes": entry.size, "peak_extra": rss.peak - before}


def _restore_rounds(server, store, rounds: int, cold: bool) -> tuple[list[tuple[float, float, float]], object]:
    """(dd read MB/s, restore MB/s, restore s) per round, each restore right after dd reads the file."""
    from ps.server.participant import shard_files
    from services.checkpoint.parts import restore_newest

    out, restored = [], None
    path = store.folder(1) / "ps0.pt"
    for _ in range(max(1, rounds)):
        dd_read = _dd_read(path, cold)
        if cold:
            _drop_caches()
        t0 = time.perf_counter()
        info, restored = restore_newest(store, True, None,   # as a server starts
                                        lambda info: shard_files(info, server.spec, server.layout.slots, "ps0"),
                                        lambda states: _server(server.spec.meta["rows"], server.spec.meta["dim"], states))
        seconds = time.perf_counter() - t0
        assert info is not None and info.step == 1
        out.append((dd_read, path.stat().st_size / seconds / 1e6, seconds))
    return out, restored


def _identical(a, b) -> bool:
    import torch
    same = all(torch.equal(x, y) for x, y in zip(a.optimizer.params, b.optimizer.params))
    for x, y in zip(a.optimizer.params, b.optimizer.params):
        saved, back = a.optimizer.optimizer.state.get(x, {}), b.optimizer.optimizer.state.get(y, {})
        same &= saved.keys() == back.keys() and all(torch.equal(saved[k], back[k]) for k in saved)
    return same


def run(ns: argparse.Namespace) -> int:
    import torch

    from services.checkpoint.store import CheckpointStore

    torch.set_num_threads(1)
    server = _server(ns.rows, ns.dim)
    shard_bytes = _bytes(server)
    tmp = Path(tempfile.mkdtemp(prefix="rpcps-bench-ckpt-", dir=ns.dir))
    try:
        cold = _drop_caches()  # where allowed, both reads below start from the disk, not the cache
        dd_write = _dd_write(tmp, shard_bytes)
        store = CheckpointStore(tmp / "ckpt")
        saved = _save(server, store)
        rounds, restored = _restore_rounds(server, store, ns.rounds, cold)
        identical = _identical(server, restored)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    save_s, pause_s, file_bytes = saved["save_s"], saved["pause_s"], saved["file_bytes"]
    result = {
        "shard_mb": shard_bytes / 1e6, "file_mb": file_bytes / 1e6,
        "save_mb_per_s": file_bytes / save_s / 1e6, "dd_write_fsync_mb_per_s": dd_write,
        "save_s": save_s, "pause_s": pause_s,
        "restore_rounds": [{"dd_read_mb_per_s": d, "restore_mb_per_s": r, "restore_s": t, "restore_vs_dd": r / d}
                           for d, r, t in rounds],
        "peak_extra_mb": saved["peak_extra"] / 1e6, "bit_identical": identical, "reads_from_cold_cache": cold,
    }
    ratios = {"save_vs_dd": result["save_mb_per_s"] / dd_write,
              "restore_vs_dd": statistics.median(r / d for d, r, _ in rounds),
              "pause_vs_save": pause_s / save_s, "extra_memory_vs_shard": saved["peak_extra"] / shard_bytes}
    met = {k: (v <= TARGETS[k] if k in ("pause_vs_save", "extra_memory_vs_shard") else v >= TARGETS[k])
           for k, v in ratios.items()}
    print(json.dumps({"bench": "checkpoint", "results": result, "ratios": ratios, "targets": TARGETS, "met": met,
                      "config": {"rows": ns.rows, "dim": ns.dim, "rounds": ns.rounds, "optimizer": "adagrad",
                                 "dir": str(ns.dir.resolve()), "load_avg": os.getloadavg()}}), flush=True)
    return 0

"""Checkpoints on disk: ``<dir>/step-<step>/`` with one file per shard or trainer and a
``manifest.json`` written last.

Every file is written beside its final name, fsynced and renamed; the manifest (sizes and sha256 of
every file, plus whatever the caller describes: cluster shape, model) is written the same way, last.
A folder without a valid manifest does not exist for restore. Files load with
``torch.load(weights_only=True)``, so loading never runs code from the file. No RPC here.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from services.errors import CheckpointError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = 1
# Besides each file's sha256, the manifest holds one sha256 per CHUNK bytes, so a restore can verify
# a file on every core at once instead of being bound by one core's hashing speed.
CHUNK = 64 << 20
_FOLDER = re.compile(r"^step-(\d+)$")
_FILE = re.compile(r"^[A-Za-z0-9_.]+$")


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    sha256: str
    chunks: tuple[str, ...] = ()   # sha256 of each CHUNK-byte piece; empty in manifests without them

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "sha256": self.sha256, "chunk_bytes": CHUNK, "chunks": list(self.chunks)}


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    created: float
    files: dict[str, FileEntry]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.path.name

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files.values())

    @property
    def kind(self) -> str:
        """"full", or "delta": some of its files hold only what changed since another checkpoint."""
        return "delta" if self.bases else "full"

    @property
    def bases(self) -> dict[str, str]:
        """Each file that is a delta -> the id of the checkpoint it applies to."""
        return dict(self.meta.get("delta") or {})

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "step": self.step, "path": str(self.path), "created": self.created,
                "size_bytes": self.size, "files": sorted(self.files), "kind": self.kind,
                **({"bases": sorted(set(self.bases.values()))} if self.bases else {})}


class _HashingWriter:
    """A file object that hashes what passes through it (whole file and per chunk), so nothing is
    read back to checksum it. Large writes (tensor storages) are hashed twice and written on three
    threads at once: hashlib and file writes release the GIL, and a save must keep up with the disk."""

    _PARALLEL_FROM = 1 << 20

    def __init__(self, f, pool: ThreadPoolExecutor) -> None:
        self._f, self._pool, self.sha = f, pool, hashlib.sha256()
        self.size = 0
        self.chunks: list[str] = []
        self._chunk, self._in_chunk = hashlib.sha256(), 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.size += view.nbytes
        if view.nbytes < self._PARALLEL_FROM:
            self.sha.update(view)
            self._hash_chunks(view)
            return self._f.write(view)
        whole = self._pool.submit(self.sha.update, view)
        pieces = self._pool.submit(self._hash_chunks, view)
        try:
            return self._f.write(view)
        finally:
            whole.result(), pieces.result()   # in order: the next write hashes after this one

    def _hash_chunks(self, view: memoryview) -> None:
        while view.nbytes:
            piece = view[:CHUNK - self._in_chunk]
            self._chunk.update(piece)
            self._in_chunk += piece.nbytes
            view = view[piece.nbytes:]
            if self._in_chunk == CHUNK:
                self.chunks.append(self._chunk.hexdigest())
                self._chunk, self._in_chunk = hashlib.sha256(), 0

    def flush(self) -> None:
        self._f.flush()

    def finish(self, name: str) -> FileEntry:
        chunks = self.chunks + ([self._chunk.hexdigest()] if self._in_chunk else [])
        return FileEntry(name, self.size, self.sha.hexdigest(), tuple(chunks))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write) -> FileEntry:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f, ThreadPoolExecutor(max_workers=2, thread_name_prefix="ckpt-hash") as pool:
        w = _HashingWriter(f, pool)
        write(w)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return w.finish(path.name)


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _chunk_matches(path: Path, index: int, expected: str) -> bool:
    # hashlib releases the GIL on large buffers, so these run in parallel in threads.
    with open(path, "rb", buffering=0) as f:
        f.seek(index * CHUNK)
        return hashlib.sha256(f.read(CHUNK)).hexdigest() == expected


class CheckpointStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def folder(self, step: int) -> Path:
        if not isinstance(step, int) or step < 0:
            raise CheckpointError(f"checkpoint step must be an int >= 0, got {step!r}")
        return self.root / f"step-{step}"

    # --- writing -------------------------------------------------------------------------------------
    def prepare(self, step: int, replace: bool = False) -> Path:
        """The folder for ``step``, emptied of any leftover of an interrupted write (and, with
        ``replace``, of a complete one: a server's own part that its cluster never committed)."""
        path = self.folder(step)
        if (path / MANIFEST).exists() and not replace:
            raise CheckpointError(f"checkpoint {path.name} already exists")
        if path.exists():
            shutil.rmtree(path)  # no manifest: the remains of a write that never finished
        path.mkdir(parents=True)
        _fsync_dir(self.root)
        return path

    def write_file(self, step: int, name: str, obj: Any) -> FileEntry:
        if not _FILE.match(name) or name == MANIFEST:
            raise CheckpointError(f"invalid checkpoint file name {name!r}")
        import torch     # here, not at the top: `rpcps checkpoint --list` reads manifests without torch
        return atomic_write(self.folder(step) / name, lambda f: torch.save(obj, f))

    def commit(self, step: int, entries: list[FileEntry], meta: Optional[dict[str, Any]] = None) -> CheckpointInfo:
        """Write the manifest: from this moment on the checkpoint exists."""
        path = self.folder(step)
        for e in entries:
            on_disk = path / e.name
            if not on_disk.is_file() or on_disk.stat().st_size != e.size:
                raise CheckpointError(f"{on_disk} is missing or not {e.size} bytes; not committing")
        manifest = {"format": FORMAT, "step": step, "created": time.time(),
                    "files": {e.name: e.to_json() for e in entries}, "meta": meta or {}}
        body = json.dumps(manifest, indent=1, sort_keys=True).encode()
        atomic_write(path / MANIFEST, lambda f: f.write(body))
        return self._info(path, manifest)

    # --- reading -------------------------------------------------------------------------------------
    def list(self) -> list[CheckpointInfo]:
        """Checkpoints with a readable manifest whose files exist at their sizes, newest first."""
        found = []
        for _, info in self.scan():
            if isinstance(info, CheckpointInfo):
                found.append(info)
            else:
                log.info("not a checkpoint: %s", info)
        return found

    def scan(self) -> list[tuple[Path, "CheckpointInfo | CheckpointError"]]:
        """Every ``step-N`` folder, newest first, with its checkpoint or why it is none."""
        found: list[tuple[Path, CheckpointInfo | CheckpointError]] = []
        for path in self._folders():
            try:
                found.append((path, self._read(path)))
            except CheckpointError as exc:
                found.append((path, exc))
        return found

    def verify(self, info: CheckpointInfo, names: Optional[list[str]] = None, workers: Optional[int] = None) -> None:
        """Raise CheckpointError unless every named file (default: all) matches its checksums.

        Chunks are hashed on ``workers`` threads (default: one more than cores, so a thread waiting
        for the disk leaves no core idle); a file whose manifest has no chunk hashes is hashed whole.
        """
        checks = []   # (file name, function that is True when it matches)
        for name in names if names is not None else list(info.files):
            entry, path = info.files[name], info.path / name
            if entry.chunks:
                checks += [(name, lambda p=path, i=i, h=h: _chunk_matches(p, i, h)) for i, h in enumerate(entry.chunks)]
            else:
                checks.append((name, lambda p=path, h=entry.sha256: sha256_of(p) == h))
        with ThreadPoolExecutor(max_workers=max(1, min(workers or (os.cpu_count() or 1) + 1, len(checks) or 1))) as pool:
            for name, ok in zip([n for n, _ in checks], pool.map(lambda c: c[1](), checks)):
                if not ok:
                    raise CheckpointError(f"{info.id}: {name} does not match its sha256")

    def latest_valid(self) -> Optional[CheckpointInfo]:
        """The newest checkpoint whose every file matches its checksums; older ones as fallback."""
        for path in self._folders():
            try:
                info = self._read(path)
                self.verify(info)
                return info
            except CheckpointError as exc:
                log.warning("skipping %s: %s", path.name, exc)
        return None

    def resolve(self, ref: str, verify: bool = True) -> CheckpointInfo:
        """A checkpoint named by id (``step-N``) or path; nothing outside the checkpoint folder."""
        root = self.root.resolve()
        candidate = Path(ref)
        path = (candidate if candidate.is_absolute() else root / candidate).resolve()
        if path.parent != root or not _FOLDER.match(path.name):
            raise CheckpointError(f"{ref!r} is not a checkpoint folder inside {root}")
        info = self._read(path)
        if verify:
            self.verify(info)
        return info

    def chain(self, info: CheckpointInfo, name: str) -> list[CheckpointInfo]:
        """The checkpoints file ``name`` of ``info`` is rebuilt from, oldest first: the one holding
        it whole, then each delta on it up to ``info``. ``CheckpointError`` if one is missing."""
        out = [info]
        while name in out[-1].bases:
            base = out[-1].bases[name]
            if any(c.id == base for c in out):
                raise CheckpointError(f"{info.id}: the deltas of {name} go round in a circle through {base}")
            try:
                found = self.resolve(base, verify=False)
            except CheckpointError as exc:
                raise CheckpointError(f"{info.id}: {name} is a delta on {base}, which is not usable ({exc})") from None
            if name not in found.files:
                raise CheckpointError(f"{info.id}: {name} is a delta on {base}, which has no {name}")
            out.append(found)
        return out[::-1]

    def load_file(self, info: CheckpointInfo, name: str) -> Any:
        entry = info.files.get(name)
        if entry is None:
            raise CheckpointError(f"{info.id} has no file {name!r} (it has {sorted(info.files)})")
        import torch
        # mmap: tensors map the file privately (copy-on-write), so nothing is copied up front and
        # the file may be pruned later without touching what was loaded.
        return torch.load(info.path / name, weights_only=True, map_location="cpu", mmap=True)

    def prune(self, keep: int) -> list[Path]:
        """Remove all but the newest ``keep`` valid checkpoints (and those their deltas apply to),
        and leftovers older than the newest."""
        if keep < 1:
            raise CheckpointError(f"keep must be >= 1, got {keep}")
        valid = self.list()
        if not valid:
            return []
        keep_paths = {c.path for c in valid[:keep]}
        by_id = {c.id: c for c in valid}
        needed = [b for c in valid[:keep] for b in c.bases.values()]
        while needed:            # what a kept delta applies to, and what that one does
            base = by_id.get(needed.pop())
            if base is not None and base.path not in keep_paths:
                keep_paths.add(base.path)
                needed += base.bases.values()
        newest = valid[0].step
        removed = []
        for path in self._folders():
            step = int(_FOLDER.match(path.name).group(1))
            if path in keep_paths or step >= newest:
                continue  # never touch anything as new as the newest complete checkpoint
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        return removed

    def _folders(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        folders = [p for p in self.root.iterdir() if p.is_dir() and _FOLDER.match(p.name)]
        return sorted(folders, key=lambda p: int(_FOLDER.match(p.name).group(1)), reverse=True)

    def _read(self, path: Path) -> CheckpointInfo:
        """The manifest's view of a folder, checked for shape and file sizes (not checksums)."""
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{path.name} has no manifest (an unfinished write)") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path.name}: unreadable manifest ({exc})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
            raise CheckpointError(f"{path.name}: manifest is not a format-{FORMAT} rpcps manifest")
        if manifest.get("step") != int(_FOLDER.match(path.name).group(1)):
            raise CheckpointError(f"{path.name}: manifest says step {manifest.get('step')!r}")
        info = self._info(path, manifest)
        for e in info.files.values():
            f = path / e.name
            if not _FILE.match(e.name) or not f.is_file():
                raise CheckpointError(f"{path.name}: file {e.name} is missing")
            if f.stat().st_size != e.size:
                raise CheckpointError(f"{path.name}: {e.name} is {f.stat().st_size} bytes, manifest says {e.size}")
            if e.chunks and len(e.chunks) != -(-e.size // CHUNK):
                raise CheckpointError(f"{path.name}: {e.name} has {len(e.chunks)} chunk hashes for {e.size} bytes")
        return info

    @staticmethod
    def _info(path: Path, manifest: dict) -> CheckpointInfo:
        try:
            files = {n: FileEntry(n, int(v["size"]), str(v["sha256"]), tuple(map(str, v.get("chunks") or ())))
                     for n, v in manifest["files"].items()}
            if any(v.get("chunks") and v.get("chunk_bytes") != CHUNK for v in manifest["files"].values()):
                raise ValueError(f"chunk_bytes is not {CHUNK}")
            return CheckpointInfo(int(manifest["step"]), path, float(manifest["created"]), files,
                                  dict(manifest.get("meta") or {}))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path.name}: malformed manifest ({exc})") from None

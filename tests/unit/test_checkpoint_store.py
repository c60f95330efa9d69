import json
import os

import pytest
import torch

import hashlib

from services.checkpoint import store as checkpoint
from services.checkpoint.store import MANIFEST, CheckpointStore
from services.errors import CheckpointError


def save(store, step, tensors, meta=None):
    store.prepare(step)
    entries = [store.write_file(step, name, t) for name, t in tensors.items()]
    return store.commit(step, entries, meta or {"num_ps": 2})


def test_round_trip_is_bit_identical(tmp_path):
    store = CheckpointStore(tmp_path)
    state = {"w": torch.randn(5, 3), "ids": torch.arange(7), "nested": {"lr": 0.5}}
    info = save(store, 12, {"ps0.pt": state})
    back = store.load_file(store.resolve("step-12"), "ps0.pt")
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["ids"], state["ids"]) and back["nested"] == {"lr": 0.5}
    assert info.meta == {"num_ps": 2} and info.size == os.path.getsize(tmp_path / "step-12" / "ps0.pt")
    assert not list((tmp_path / "step-12").glob("*.tmp"))


def test_newest_first_and_folders_without_manifest_do_not_exist(tmp_path):
    store = CheckpointStore(tmp_path)
    save(store, 5, {"a.pt": torch.ones(1)})
    save(store, 10, {"a.pt": torch.ones(2)})
    store.prepare(15)                                   # a write that never committed
    store.write_file(15, "a.pt", torch.ones(3))
    assert [c.step for c in store.list()] == [10, 5]
    assert store.latest_valid().step == 10


def test_corrupt_file_falls_back_to_the_previous_checkpoint(tmp_path, caplog):
    store = CheckpointStore(tmp_path)
    save(store, 1, {"a.pt": torch.zeros(100)})
    save(store, 2, {"a.pt": torch.ones(100)})
    f = tmp_path / "step-2" / "a.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF                          # same size, one flipped byte
    f.write_bytes(bytes(data))
    assert store.latest_valid().step == 1
    assert "does not match its sha256" in caplog.text
    with pytest.raises(CheckpointError, match="sha256"):
        store.resolve("step-2")


@pytest.mark.parametrize("parallel_from", [1 << 30, 1], ids=["inline", "threads"])
def test_chunk_hashes_cover_the_file_and_catch_a_flip_in_any_chunk(tmp_path, monkeypatch, parallel_from):
    monkeypatch.setattr(checkpoint, "CHUNK", 4096)      # many chunks from a small file
    monkeypatch.setattr(checkpoint._HashingWriter, "_PARALLEL_FROM", parallel_from)
    store = CheckpointStore(tmp_path)
    save(store, 1, {"a.pt": torch.zeros(100)})
    info = save(store, 2, {"a.pt": torch.arange(5000.0)})
    data = (tmp_path / "step-2" / "a.pt").read_bytes()
    entry = info.files["a.pt"]
    assert entry.sha256 == hashlib.sha256(data).hexdigest()   # the whole-file sum stays, for sha256sum
    assert list(entry.chunks) == [hashlib.sha256(data[i:i + 4096]).hexdigest() for i in range(0, len(data), 4096)]
    assert len(entry.chunks) > 4
    store.verify(store.resolve("step-2"), workers=3)
    broken = bytearray(data)
    broken[-1] ^= 0x01                                   # the last, partial chunk
    (tmp_path / "step-2" / "a.pt").write_bytes(bytes(broken))
    with pytest.raises(CheckpointError, match="a.pt does not match"):
        store.verify(store.resolve("step-2", verify=False), workers=3)
    assert store.latest_valid().step == 1


@pytest.mark.parametrize("damage", ["truncate", "garbage", "wrong_step", "missing_file", "short_file"])
def test_damaged_manifests_and_files_are_ignored(tmp_path, damage):
    store = CheckpointStore(tmp_path)
    save(store, 1, {"a.pt": torch.zeros(10)})
    save(store, 2, {"a.pt": torch.ones(10)})
    m = tmp_path / "step-2" / MANIFEST
    if damage == "truncate":
        m.write_bytes(m.read_bytes()[: len(m.read_bytes()) // 2])
    elif damage == "garbage":
        m.write_bytes(b"\x00\xff not json")
    elif damage == "wrong_step":
        body = json.loads(m.read_text())
        body["step"] = 7
        m.write_text(json.dumps(body))
    elif damage == "missing_file":
        (tmp_path / "step-2" / "a.pt").unlink()
    else:
        f = tmp_path / "step-2" / "a.pt"
        f.write_bytes(f.read_bytes()[:-5])
    assert [c.step for c in store.list()] == [1]
    assert store.latest_valid().step == 1


@pytest.mark.parametrize("ref", ["../etc", "/etc", "step-1/../../x", "step-1/a.pt", "notastep", "../step-1"])
def test_references_cannot_reach_outside_the_checkpoint_dir(tmp_path, ref):
    store = CheckpointStore(tmp_path / "ckpt")
    save(store, 1, {"a.pt": torch.zeros(1)})
    with pytest.raises(CheckpointError):
        store.resolve(ref)
    assert store.resolve(str(tmp_path / "ckpt" / "step-1")).step == 1   # an absolute path inside is fine


def test_files_load_without_executing_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    store = CheckpointStore(tmp_path)
    store.prepare(3)
    entry = store.write_file(3, "evil.pt", {"x": Evil()})
    info = store.commit(3, [entry])
    with pytest.raises(Exception):
        store.load_file(info, "evil.pt")
    assert not (tmp_path / "pwned").exists()


def test_prune_keeps_the_newest_and_never_touches_a_newer_partial(tmp_path):
    store = CheckpointStore(tmp_path)
    for step in (1, 2, 3, 4):
        save(store, step, {"a.pt": torch.zeros(1)})
    store.prepare(5)                                   # in progress right now
    store.prepare(0)                                   # an old leftover
    removed = store.prune(keep=2)
    assert sorted(p.name for p in removed) == ["step-0", "step-1", "step-2"]
    assert [c.step for c in store.list()] == [4, 3] and (tmp_path / "step-5").is_dir()


def test_bad_names_and_double_commits_are_refused(tmp_path):
    store = CheckpointStore(tmp_path)
    save(store, 1, {"a.pt": torch.zeros(1)})
    with pytest.raises(CheckpointError, match="already exists"):
        store.prepare(1)
    store.prepare(2)
    for name in ("../x.pt", "manifest.json", "a/b.pt", ""):
        with pytest.raises(CheckpointError):
            store.write_file(2, name, torch.zeros(1))


def test_replacing_a_complete_folder_is_explicit(tmp_path):
    # A server's own part of a step its cluster never committed is replaced when that step comes again.
    store = CheckpointStore(tmp_path)
    save(store, 3, {"ps1.pt": torch.zeros(2)})
    store.prepare(3, replace=True)
    assert list((tmp_path / "step-3").iterdir()) == [] and store.list() == []
    save(store, 3, {"ps1.pt": torch.ones(2)})
    assert torch.equal(store.load_file(store.resolve("step-3"), "ps1.pt"), torch.ones(2))

"""Checkpoints users already have keep loading: files written by the code of commit e73f547
(``tests/fixtures/checkpoints-e73f547``) restore into today's code with identical state."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.support.rows import held, each_storage  # noqa: F401 (autouse: packed and gridded)
from prometheus_client import CollectorRegistry

from ps.server.metrics import PsMetrics
from ps.server.participant import shard_files
from ps.server.service import ParameterServer
from ps.spec.sharding import resumed_slots
from services.checkpoint.parts import restore_newest
from services.checkpoint.store import CheckpointStore
from trainer.lm.config import LmModelConfig
from trainer.lm.model import model_spec
from trainer.lm.position import resume_point
from trainer.rl.policy import Learner, LearnerConfig, LearnerPart

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoints-e73f547"
ROW_PARAMS = ("embedding.weight", "decoder.weight", "decoder.bias")


@pytest.fixture
def lm_store(tmp_path) -> CheckpointStore:
    shutil.copytree(FIXTURES / "lm", tmp_path / "lm")
    return CheckpointStore(tmp_path / "lm")


def saved_shards(store: CheckpointStore) -> list[dict]:
    info = store.latest_valid()
    return [torch.load(info.path / f"ps{k}.pt", weights_only=True) for k in range(info.meta["num_ps"])]


def whole(shards: list[dict], part: str) -> dict[str, torch.Tensor]:
    """Every parameter (``part="params"``) or Adagrad sum (``"optim"``) of the cluster, rows by global id."""
    out: dict[str, torch.Tensor] = {}
    for shard in shards:
        ids = shard["tables"]["vocabulary"] if "tables" in shard else shard["global_ids"]   # today's, and e73f547's
        for name, value in shard[part].items():
            value = value["sum"] if part == "optim" else value
            if name in ROW_PARAMS:
                if name not in out:
                    out[name] = torch.empty(shard["model"]["ntoken"], *value.shape[1:])
                rows, at = held(ids)
                out[name][at] = value[rows]
            else:
                out[name] = value
    return out


@pytest.mark.parametrize("num_ps", [2, 1, 3])
def test_language_model_shards_restore_identical(lm_store, num_ps):
    info = lm_store.latest_valid()
    spec = model_spec(LmModelConfig.model_validate(info.meta["model"]))
    servers = []
    slots = resumed_slots(spec, [f"ps{k}" for k in range(num_ps)], info.meta.get("layout"))
    for shard in range(num_ps):
        resumed, server = restore_newest(lm_store, True, None,
                                         lambda info, k=shard: shard_files(info, spec, slots, f"ps{k}"),
                                         lambda states, k=shard: ParameterServer(
                                             f"ps{k}", k, slots, spec, PsMetrics(CollectorRegistry(), "ps", f"ps{k}"),
                                             restore=states))
        assert resumed is not None and resumed.id == "step-12"
        assert server.optimizer.steps == 12
        servers.append(server)
    restored = [s.export_state() for s in servers]
    old = saved_shards(lm_store)
    for part in ("params", "optim"):
        expected, got = whole(old, part), whole(restored, part)
        assert expected.keys() == got.keys()
        for name in expected:
            assert torch.equal(expected[name], got[name]), (part, name)


def test_trainer_positions_resume_exactly(lm_store):
    info = lm_store.latest_valid()
    saved = [lm_store.load_file(info, f"trainer{i}.pt") for i in range(2)]
    point, why = resume_point(saved, "trainer1", 2, "synthetic corpus (200000 tokens, seed 1111)", 5000)
    assert why == "same trainers, same data"
    assert (point.position, point.epoch, point.steps) == (210, 0, 6)
    assert torch.equal(point.hidden[0], saved[1]["hidden"][0])


def test_rl_agent_restores_identical(tmp_path):
    shutil.copytree(FIXTURES / "rl", tmp_path / "rl")
    store = CheckpointStore(tmp_path / "rl")
    state = store.load_file(store.latest_valid(), "agent.pt")
    part = LearnerPart(Learner(LearnerConfig(seed=1111)))
    part.load_state_dict(state)
    back = part.state_dict()
    assert (back["episodes"], back["running_reward"]) == (3, state["running_reward"])
    assert all(torch.equal(back["policy"][k], v) for k, v in state["policy"].items())
    assert back["generators"].keys() == state["generators"].keys()
    assert all(torch.equal(back["generators"][k], v) for k, v in state["generators"].items())

import asyncio

import httpx
import pytest
from prometheus_client import CollectorRegistry

from services.sidecar import create_app
from tests.support.fakes import FakeControl
from trainer.lm.metrics import TrainerMetrics


def request(app, method, path, **kw):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, path, **kw)
    return asyncio.run(go())


@pytest.fixture
def control():
    return FakeControl()


@pytest.fixture
def registry():
    r = CollectorRegistry()
    m = TrainerMetrics(r, "trainer", "trainer0")
    m.steps.inc(3)
    return r


def test_probes_and_status(control, registry):
    app = create_app(control, registry)
    assert request(app, "GET", "/healthz").status_code == 200
    assert request(app, "GET", "/readyz").status_code == 200
    control.is_ready = False
    r = request(app, "GET", "/readyz")
    assert r.status_code == 503 and r.json()["reason"] == "joining"
    assert request(app, "GET", "/status").json()["name"] == "trainer0"


def test_episode_control_maps_domain_errors(control, registry):
    app = create_app(control, registry)
    r = request(app, "POST", "/episode/start", json={"steps": 5})
    assert r.status_code == 200 and control.calls == [("start", 5)]
    r = request(app, "POST", "/episode/start", json={"steps": 5})
    assert r.status_code == 409 and "already running" in r.json()["error"]
    assert request(app, "POST", "/episode/stop").status_code == 200
    assert request(app, "POST", "/episode/stop").status_code == 409
    assert request(app, "POST", "/episode/start").status_code == 200   # no body: unbounded
    assert control.calls[-1] == ("start", None)


def test_malformed_bodies_are_422_json(control, registry):
    app = create_app(control, registry)
    for body in ({"steps": 0}, {"steps": "x"}, {"stepz": 3}):
        r = request(app, "POST", "/episode/start", json=body)
        assert r.status_code == 422 and r.json()["error"].startswith("invalid request"), body
    r = request(app, "POST", "/episode/start", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert control.calls == []


def test_token_guards_posts_only(control, registry):
    app = create_app(control, registry, token="s3cret")
    assert request(app, "POST", "/episode/start", json={"steps": 1}).status_code == 401
    assert request(app, "POST", "/episode/start", json={"steps": 1},
                   headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert control.calls == []
    assert request(app, "POST", "/episode/start", json={"steps": 1},
                   headers={"Authorization": "Bearer s3cret"}).status_code == 200
    for path in ("/healthz", "/readyz", "/metrics", "/status"):
        assert request(app, "GET", path).status_code == 200, path


def test_not_supported_is_501(control, registry):
    r = request(create_app(control, registry), "POST", "/checkpoint")
    assert r.status_code == 501 and r.json()["type"] == "NotSupported"


def test_metrics_exposition_names_and_labels(control, registry):
    r = request(create_app(control, registry), "GET", "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = [l for l in r.text.splitlines() if l and not l.startswith("#") and not l.startswith("process_")]
    assert samples and all(l.startswith("rpcps_") for l in samples), "rpcps_ metrics, and the standard process_ ones"
    assert all('role="trainer"' in l and 'name="trainer0"' in l for l in samples)
    assert "process_open_fds" in r.text and "process_max_fds" in r.text
    assert 'rpcps_trainer_steps_total{name="trainer0",role="trainer"} 3.0' in r.text
    assert 'rpcps_trainer_step_seconds_count{name="trainer0",phase="backward",role="trainer"} 0.0' in r.text


def test_overlapping_checkpoint_is_409(registry, tmp_path):
    from services.checkpoint.store import CheckpointStore
    from services.checkpoint.coordinator import CheckpointPlan, Coordinator
    from services.errors import CheckpointInProgress

    from prometheus_client import CollectorRegistry

    from services.metrics import Metrics
    metrics = Metrics(CollectorRegistry(), "ps", "ps0")
    coordinator = Coordinator(CheckpointStore(tmp_path), CheckpointPlan(holders=("ps0",)), keep=3, local=None,
                              metrics=metrics)
    with coordinator._lock:  # a checkpoint under way
        with pytest.raises(CheckpointInProgress):
            coordinator.take()

    class Busy(FakeControl):
        def checkpoint(self):
            return coordinator.take()

    with coordinator._lock:
        r = request(create_app(Busy(), registry), "POST", "/checkpoint")
    assert r.status_code == 409 and "being taken" in r.json()["error"]
    assert metrics.checkpoint_failures._value.get() == 0     # an overlap is not a failure


def test_every_error_has_the_documented_shape_and_openapi_lists_it(control, registry):
    app = create_app(control, registry, token="s3cret")
    auth = {"Authorization": "Bearer s3cret"}
    answers = [("/episode/start", request(app, "POST", "/episode/start", json={"steps": 1})),             # 401
               ("/episode/start", request(app, "POST", "/episode/start", content=b"{not json",
                                          headers={**auth, "content-type": "application/json"})),       # 422
               ("/episode/stop", request(app, "POST", "/episode/stop", headers=auth)),                   # 409
               ("/checkpoint", request(app, "POST", "/checkpoint", headers=auth))]                       # 501
    control.is_ready = False
    answers.append(("/episode/start", request(app, "POST", "/episode/start", json={"steps": 1}, headers=auth)))
    documented = app.openapi()["paths"]
    for path, r in answers:
        assert r.status_code >= 400 and set(r.json()) == {"error", "type"}, (path, r.status_code, r.text)
        assert str(r.status_code) in documented[path]["post"]["responses"], (path, r.status_code)
    assert {r.status_code for _, r in answers} == {401, 422, 409, 501, 503}
    # Starlette's own errors too: an unknown path, a wrong method.
    for method, path, code in (("GET", "/nope", 404), ("DELETE", "/status", 405)):
        r = request(app, method, path)
        assert r.status_code == code and set(r.json()) == {"error", "type"}, r.text

"""The image built and ``docker-compose.yml`` run by a real container engine, as a user runs them:
podman with podman-compose (``tests/support/podman.py``), the image built from the Dockerfile with
a Debian base made from Debian's archive and a local wheelhouse (no registry or index is reachable
from a build here). The default profile comes up, every sidecar answers ``/status``, ``POST
/checkpoint`` writes a checkpoint that verifies, Prometheus scrapes every member; then the CTR and
serve profiles: ``/predict`` answers from the exported model; ``down -v`` leaves nothing behind."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.deploy import COMPOSE, DOCKERFILE, REPO
from tests.support.podman import Engine, missing
from tests.support.wait import wait_until

TOKEN = "engine-test-token"
BASE = "localhost/bookworm-python"
PROMETHEUS = "localhost/prometheus-debian"
DEFAULT = {"ps0": 8080, "ps1": 8081, "trainer0": 8082, "trainer1": 8083}
CTR = {"ctr-ps0": 8100, "ctr-ps1": 8101, "ctr0": 8102, "ctr1": 8103}


def build_context(folder: Path) -> Path:
    """What the Dockerfile copies (its COPY lines' sources), and a wheelhouse of the pinned list."""
    folder.mkdir()
    shutil.copy(DOCKERFILE, folder / "Dockerfile")
    for sources in re.findall(r"^COPY (.+) \S+$", DOCKERFILE.read_text(), re.M):
        for source in sources.split():
            (shutil.copytree if (REPO / source).is_dir() else shutil.copy)(REPO / source, folder / source)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(folder / "wheels"),
                        "-r", str(REPO / "requirements.lock"), "setuptools>=77"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return folder


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """podman with the images built: the Debian base, rpcps from the Dockerfile, and Prometheus
    (Debian's binary on the same base: no registry holds prom/prometheus here)."""
    why = missing()
    if why:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("engine")
    eng = Engine(root).start()
    try:
        started = time.monotonic()
        eng.import_base(BASE, ["python3", "python3-venv"])
        based = time.monotonic()
        context = build_context(root / "context")
        eng.podman("build", "--build-arg", f"BASE={BASE}", "--build-arg", "WHEELS=wheels", "--tag", "rpcps:latest",
                   str(context), timeout=1200)
        built = time.monotonic()
        prom = root / "prometheus"
        prom.mkdir()
        shutil.copy(shutil.which("prometheus") or "/usr/bin/prometheus", prom / "prometheus")
        (prom / "Containerfile").write_text(f"FROM {BASE}\nCOPY prometheus /bin/prometheus\n"
                                            "ENTRYPOINT [\"/bin/prometheus\"]\n")
        eng.podman("build", "--tag", PROMETHEUS, str(prom))
        for folder in (context, prom):          # 300 MB of wheels and a binary, in the images now
            shutil.rmtree(folder)
        print(f"\nengine: base image {based - started:.0f} s, rpcps image {built - based:.0f} s")
        yield eng
    finally:
        eng.close()


def compose(eng: Engine, *argv: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    """``podman-compose`` with the user's .env: the token, ports published on the engine's address."""
    env = {"RPCPS_CONTROL_TOKEN": TOKEN, "RPCPS_PUBLISH_ADDR": eng.address, "RPCPS_PROMETHEUS_IMAGE": PROMETHEUS,
           "RPCPS_CTR_SCALE": "0.001"}
    return eng.run(["podman-compose", "-f", str(COMPOSE), *argv], cwd=REPO, env=env, timeout=timeout, check=check)


def url(eng: Engine, port: int, path: str) -> str:
    return f"http://{eng.address}:{port}{path}"


def statuses(eng: Engine, ports: dict[str, int]) -> dict[str, dict]:
    out = {}
    for name, port in ports.items():
        try:
            out[name] = httpx.get(url(eng, port, "/status"), timeout=3).json()
        except httpx.HTTPError:
            return {}
    return out


def stepping(eng: Engine, ports: dict[str, int], trainers: list[str]):
    s = statuses(eng, ports)
    return s if s and all(m.get("state") == "running" for m in s.values()) and \
        all((s[t].get("step") or 0) >= 1 for t in trainers) else None


def scraped(eng: Engine, names: set[str]) -> bool:
    targets = httpx.get(url(eng, 9090, "/api/v1/targets"), timeout=5).json()["data"]["activeTargets"]
    up = {t["labels"].get("name") for t in targets if t["health"] == "up"}
    return names <= up


@pytest.mark.timeout(1500)          # building the images is part of it: 2-3 min here
def test_the_compose_file_runs_under_a_container_engine(engine):
    eng = engine
    try:
        started = time.monotonic()
        compose(eng, "up", "-d")
        seen = wait_until(lambda: stepping(eng, DEFAULT, ["trainer0", "trainer1"]), 300,
                          "every sidecar of the default profile answering, both trainers stepping")
        ready = time.monotonic() - started
        assert {n: s["role"] for n, s in seen.items()} == {"ps0": "ps", "ps1": "ps", "trainer0": "trainer",
                                                          "trainer1": "trainer"}

        # A checkpoint asked of ps1 with the token, verified inside the cluster's own volume.
        assert httpx.post(url(eng, 8081, "/checkpoint"), timeout=60).status_code == 401
        taken = httpx.post(url(eng, 8081, "/checkpoint"), headers={"Authorization": f"Bearer {TOKEN}"},
                           timeout=120).json()
        listed = json.loads(compose(eng, "exec", "-T", "ps0", "rpcps", "checkpoint", "--list", "--verify", "--json",
                                    "--checkpoint-dir", "/checkpoints").stdout)
        mine = {c["id"]: c for c in listed["checkpoints"]}[taken["id"]]
        assert mine["state"] == "verified" and sorted(mine["files"]) == ["ps0.pt", "ps1.pt", "trainer0.pt",
                                                                         "trainer1.pt"], mine
        wait_until(lambda: scraped(eng, set(DEFAULT)), 120, "Prometheus scraping every member, found by DNS")

        # The CTR profile beside it, then the serve profile: its newest checkpoint exported and served.
        compose(eng, "--profile", "ctr", "up", "-d")
        wait_until(lambda: stepping(eng, CTR, ["ctr0", "ctr1"]), 300, "the CTR cluster's trainers stepping")
        ctr = httpx.post(url(eng, 8100, "/checkpoint"), headers={"Authorization": f"Bearer {TOKEN}"},
                         timeout=120).json()
        compose(eng, "--profile", "serve", "up", "-d", "ctr-serve0")
        wait_until(lambda: httpx.get(url(eng, 8110, "/readyz"), timeout=3).status_code == 200, 180,
                   "ctr-serve0 ready")
        row = {**{f"I{j}": j for j in range(1, 14)}, **{f"C{t}": f"{t:08x}" for t in range(1, 27)}}
        answer = httpx.post(url(eng, 8110, "/predict"), json={"rows": [row, dict(row, C3=None)]}, timeout=30).json()
        assert len(answer["predictions"]) == 2 and answer["served"]["checkpoint"] == ctr["id"], answer
        wait_until(lambda: scraped(eng, {"ps0", "ps1", "ctr0", "ctr1", "serve0"}), 120,
                   "Prometheus scraping the CTR cluster and the serving member too")
    except AssertionError as exc:
        logs = [compose(eng, "--profile", "ctr", "--profile", "serve", "logs", "--tail", "25", name, check=False,
                        timeout=120) for name in [*DEFAULT, *CTR, "ctr-export", "ctr-serve0"]]
        raise AssertionError("\n".join([str(exc), *(r.stdout[-2500:] + r.stderr[-500:] for r in logs)])) from None
    finally:
        stopping = time.monotonic()
        compose(eng, "--profile", "ctr", "--profile", "serve", "down", "-v", check=False, timeout=300)
        down = time.monotonic() - stopping
    assert eng.podman("ps", "--all", "--quiet").stdout.split() == []
    assert eng.podman("volume", "ls", "--quiet").stdout.split() == []
    assert "rpcps" not in eng.podman("network", "ls", "--format", "{{.Name}}").stdout
    print(f"\ncompose: up to every sidecar ready and trainers stepping {ready:.1f} s; down -v {down:.1f} s")

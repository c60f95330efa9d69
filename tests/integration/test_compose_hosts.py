"""docker-compose.yml run without a container engine: every service of a profile is a
separate host (a network namespace with its own address, found by name through DNS as compose's
network finds it), running the service's own command and environment. The cluster trains; curl
reaches the sidecars across hosts; Debian's Prometheus, started with the shipped
deploy/prometheus.yml, scrapes every role; a machine outside the cluster reaches what compose
publishes and nothing else; `down` leaves a final checkpoint and `up` resumes it. And a host's
link limited to a rate, as the link benchmark limits it.

Skipped, saying why, where network namespaces cannot be made (not root, or no iproute2).
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from tests.support.deploy import REPO, compose, interpolate, k8s_prometheus_config, k8s_pod_targets
from tests.support.hosts import TOKEN, Hosts, get_json
from tests.support.netns import ComposeNetwork, Unavailable
from tests.support.wait import wait_until


@pytest.fixture
def network():
    """Makes the hosts of the given compose services (one network per test); removes them after."""
    made: list[ComposeNetwork] = []

    def make(services: dict[str, dict]) -> ComposeNetwork:
        if shutil.which("prometheus") is None or shutil.which("curl") is None:
            pytest.skip("needs Debian's prometheus package and curl")
        net = ComposeNetwork(list(services))
        try:
            net.create()
        except Unavailable as exc:
            pytest.skip(f"cannot run the compose services as separate hosts here: {exc}")
        made.append(net)
        return net

    try:
        yield make
    finally:
        for net in made:
            net.close()


def _answers(hosts: Hosts, url: str) -> bool:
    """Whether ``url`` answers 200 to curl run on the Prometheus host."""
    r = subprocess.run(hosts.net.exec_argv("prometheus", ["curl", "-sf", "--max-time", "5", url]), capture_output=True,
                       timeout=30)
    return r.returncode == 0


def query(prometheus: str, expr: str) -> list[dict]:
    r = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=5.0)
    r.raise_for_status()
    return r.json()["data"]["result"]


def wait_scraped(hosts: Hosts, prometheus: str, roles: list[str], series: dict[str, set[str]]) -> None:
    """Until Prometheus has ``up == 1`` for exactly ``roles`` (labelled with their role and name:
    a prefixed service's, ``ctr-ps0``, are ``ps`` and ``ps0``), and each query in ``series`` is
    nonzero for exactly the names given."""
    def scraped() -> bool:
        hosts.alive()
        try:
            up = {(s["metric"].get("role"), s["metric"].get("name")): s["value"][1] for s in query(prometheus, "up")}
            found = {expr: {s["metric"]["name"] for s in query(prometheus, expr)} for expr in series}
        except httpx.HTTPError:
            return False
        named = [n.split("-")[-1] for n in roles]
        return up == {(n.rstrip("0123456789"), n): "1" for n in named} and found == series
    wait_until(scraped, 90, f"Prometheus: up == 1 for {roles}, and {series}")


def publish(net: ComposeNetwork, services: dict[str, dict], environ: dict[str, str]) -> set[tuple[str, int]]:
    """The services' ``ports:``, interpolated from ``environ`` and forwarded from the docker host
    as compose would; the (address, port) pairs published."""
    published = set()
    for name, service in services.items():
        for mapping in service.get("ports") or []:
            address, port, container_port = interpolate(mapping, environ).split(":")
            net.publish(address, int(port), name, int(container_port))
            published.add((address, int(port)))
    return published


def newest_checkpoint(volume: Path) -> Path:
    return max((p for p in volume.glob("step-*") if (p / "manifest.json").exists()),
               key=lambda p: int(p.name.split("-")[1]))


@pytest.mark.timeout(420)
def test_compose_services_as_separate_hosts(network, tmp_path):
    services = {n: s for n, s in compose()["services"].items() if not s.get("profiles")}   # `docker compose up`
    net = network(services)
    hosts = Hosts(net, services, tmp_path)
    rpcps = [n for n in hosts.order if n != "prometheus"]
    try:
        hosts.up()

        # The cluster trains: every trainer's status, read from this host, shows steps.
        hosts.wait_trained(["trainer0", "trainer1"], 5)

        # Tensors cross the network, as between containers: a trainer's steps move its activations
        # and their gradients (hundreds of KB at the shipped model's size) through its eth0, not by
        # cross-memory attach (about 20 KB per step crossed before each host had its own PID namespace).
        step_bytes = [(get_json(hosts.url("trainer0", "/status"))["step"], sum(net.counters("trainer0").values()))]
        wait_until(lambda: get_json(hosts.url("trainer0", "/status"))["step"] >= step_bytes[0][0] + 5, 60,
                   "5 more steps of trainer0")
        step_bytes.append((get_json(hosts.url("trainer0", "/status"))["step"], sum(net.counters("trainer0").values())))
        per_step = (step_bytes[1][1] - step_bytes[0][1]) / (step_bytes[1][0] - step_bytes[0][0])
        print(f"trainer0's eth0: {per_step / 1e3:.0f} KB per step")
        assert per_step > 200e3, per_step

        # Host to host, by name: the control token is required, and a checkpoint asked of ps1
        # lands in the volume the servers share.
        code = hosts.curl("prometheus", "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST", "http://ps1:8080/checkpoint")
        assert code == "401"
        taken = json.loads(hosts.curl("prometheus", "-f", "-X", "POST", "-H", f"Authorization: Bearer {TOKEN}",
                                      "http://ps1:8080/checkpoint"))
        folder = tmp_path / "volumes" / "checkpoints" / taken["id"]
        manifest = json.loads((folder / "manifest.json").read_text())
        assert set(manifest["files"]) == {"ps0.pt", "ps1.pt", "trainer0.pt", "trainer1.pt"}
        status = json.loads(hosts.curl("prometheus", "-f", "http://trainer1:8080/status"))
        assert status["role"] == "trainer" and status["step"] >= 5

        # Prometheus with the shipped configuration finds every role through DNS and scrapes it.
        prometheus = f"http://{net.addresses['prometheus']}:9090"

        wait_scraped(hosts, prometheus, rpcps, {
            "rpcps_trainer_steps_total > 0": {"trainer0", "trainer1"},
            "sum by (name) (rpcps_ps_optimizer_steps_total) > 0": {"ps0", "ps1"}})
        assert (tmp_path / "volumes" / "prometheus-data" / "wal").is_dir(), "Prometheus stored its data elsewhere"

        # deploy/k8s/prometheus.yml's discovery by annotation, on the same roles: pods listed as
        # Kubernetes' pod discovery lists them (one target per port), relabelled as shipped.
        k8s = tmp_path / "k8s-prometheus"
        k8s.mkdir()
        (k8s / "pods.json").write_text(json.dumps(k8s_pod_targets({n: net.addresses[n] for n in rpcps})))
        (k8s / "prometheus.yml").write_text(yaml.safe_dump(k8s_prometheus_config(k8s / "pods.json")))
        shutil.copy(REPO / "deploy" / "alerts.yml", k8s / "alerts.yml")
        hosts.run_on("prometheus", "prometheus-k8s", [shutil.which("prometheus"), f"--config.file={k8s / 'prometheus.yml'}",
                     f"--storage.tsdb.path={k8s / 'data'}", "--web.listen-address=0.0.0.0:9091"], k8s)
        prometheus_k8s = f"http://{net.addresses['prometheus']}:9091"

        def scraped_by_annotation() -> bool:
            hosts.alive()
            try:
                up = [(s["metric"].get("role"), s["metric"].get("name"), s["value"][1]) for s in query(prometheus_k8s, "up")]
            except httpx.HTTPError:
                return False
            return sorted(up) == sorted((n.rstrip("0123456789"), n, "1") for n in rpcps)
        wait_until(scraped_by_annotation, 90, "the k8s configuration: up == 1 once per role, named as the roles are")

        # A machine on the docker host's LAN, the sidecars and Prometheus published to it (as a user
        # sets RPCPS_PUBLISH_ADDR to open them up): it reaches each of those, and no port any member
        # listens on (ps0's store, every RPC port), at the docker host's address or the member's own.
        net.add_outside("lan")
        published = publish(net, services, {"RPCPS_PUBLISH_ADDR": net.lan_address})
        listening = {n: net.listening(n) for n in rpcps}
        assert (net.addresses["ps0"], 29500) in listening["ps0"], listening
        member_ports = {(at, port) for n, found in listening.items() for _, port in found
                        for at in (net.lan_address, net.addresses[n])}
        assert net.reachable("lan", sorted(member_ports | published)) == published
        # A member does reach the store and the sidecars (the RPC ports it reaches by training). The
        # RPC ports are not probed from here: a bare connection to one of TensorPipe's listeners
        # breaks live pipes of that process (seen: both trainers failed), one more reason no
        # stranger may reach them.
        inside = {(net.addresses["ps0"], 29500), (net.addresses["ps1"], 8080)}
        assert net.reachable("trainer1", sorted(inside)) == inside

        # `docker compose down`: every role stops cleanly, and a final checkpoint is left (taken when
        # ps1, the first server to stop, stops).
        codes = hosts.down()
        assert all(code == 0 for name, code in codes.items() if name != "prometheus"), codes
        final = newest_checkpoint(folder.parent)
        assert int(final.name.split("-")[1]) > taken["step"]
        # The trainers stopped first; they left their positions with ps0, so the final checkpoint has them.
        assert set(json.loads((final / "manifest.json").read_text())["files"]) == {
            "ps0.pt", "ps1.pt", "trainer0.pt", "trainer1.pt"}

        # `docker compose up` again: the servers resume from it.
        hosts.up(["ps0", "ps1"])
        for name in ("ps0", "ps1"):
            def resumed(name=name) -> bool:
                hosts.alive()
                try:
                    return get_json(hosts.url(name, "/status")).get("resumed_from", {}).get("id") == final.name
                except httpx.HTTPError:
                    return False
            wait_until(resumed, 120, f"{name} resumed from {final.name}")
    except AssertionError as exc:
        logs = "\n".join(f"--- {n} ---\n{hosts.log(n)}" for n in hosts.order)
        raise AssertionError(f"{exc}\n{logs}") from None
    finally:
        hosts.down()


@pytest.mark.timeout(300)
def test_rl_profile_as_separate_hosts(network, tmp_path):
    # `docker compose --profile rl up agent observer0 observer1 observer2 observer3 prometheus`
    everything = compose()["services"]
    services = {n: everything[n] for n in ("agent", "observer0", "observer1", "observer2", "observer3", "prometheus")}
    assert all(everything[n].get("profiles") == ["rl"] for n in services if n != "prometheus")
    net = network(services)
    hosts = Hosts(net, services, tmp_path)
    roles = [n for n in hosts.order if n != "prometheus"]
    observers = [n for n in roles if n.startswith("observer")]
    try:
        hosts.up()

        def played() -> bool:
            hosts.alive()
            try:
                s = get_json(hosts.url("agent", "/status"))
            except httpx.HTTPError:
                return False
            return s.get("episode", 0) >= 3 and sorted(s.get("observers") or []) == observers
        wait_until(played, 120, "3 episodes played by the 4 observers")

        # Asked of an observer, by name, from another host: the agent checkpoints into its volume.
        taken = json.loads(hosts.curl("prometheus", "-f", "-X", "POST", "-H", f"Authorization: Bearer {TOKEN}",
                                      "http://observer2:8080/checkpoint"))
        volume = tmp_path / "volumes" / "rl-checkpoints"
        assert set(json.loads((volume / taken["id"] / "manifest.json").read_text())["files"]) == {"agent.pt"}

        wait_scraped(hosts, f"http://{net.addresses['prometheus']}:9090", roles,
                     {'rpcps_rl_env_steps_total{role="observer"} > 0': set(observers)})

        # `down`: observers first, then the agent, which leaves a final checkpoint.
        codes = hosts.down()
        assert all(code == 0 for name, code in codes.items() if name != "prometheus"), codes
        assert int(newest_checkpoint(volume).name.split("-")[1]) > taken["step"]
    except AssertionError as exc:
        logs = "\n".join(f"--- {n} ---\n{hosts.log(n)}" for n in hosts.order)
        raise AssertionError(f"{exc}\n{logs}") from None
    finally:
        hosts.down()


@pytest.mark.timeout(300)
def test_ctr_profile_as_separate_hosts(network, tmp_path):
    # `RPCPS_CTR_SCALE=0.01 RPCPS_CTR_TABLES=C3,C4 docker compose --profile ctr up ctr-ps0 ctr-ps1 ctr0 ctr1
    # prometheus`: two of the tables hashed.
    # Then `docker compose --profile serve up ctr-serve0`: the newest checkpoint exported, and served.
    everything = compose()["services"]
    training = ("ctr-ps0", "ctr-ps1", "ctr0", "ctr1", "prometheus")
    services = {n: everything[n] for n in (*training, "ctr-export", "ctr-serve0")}
    assert all(everything[n].get("profiles") == ["ctr"] for n in training if n != "prometheus")
    assert everything["ctr-export"]["profiles"] == everything["ctr-serve0"]["profiles"] == ["serve"]
    net = network(services)
    hosts = Hosts(net, services, tmp_path, {"RPCPS_CTR_SCALE": "0.01", "RPCPS_CTR_TABLES": "C3,C4"})
    roles = [n for n in hosts.order if n in training and n != "prometheus"]
    try:
        hosts.up([n for n in hosts.order if n in training])

        hosts.wait_trained(["ctr0", "ctr1"], 3)

        # Asked of a trainer, by name, from another host: the servers checkpoint into their own
        # volume, apart from the language model's, with both trainers' positions.
        taken = json.loads(hosts.curl("prometheus", "-f", "-X", "POST", "-H", f"Authorization: Bearer {TOKEN}",
                                      "http://ctr1:8080/checkpoint"))
        volume = tmp_path / "volumes" / "ctr-checkpoints"
        manifest = json.loads((volume / taken["id"] / "manifest.json").read_text())
        assert set(manifest["files"]) == {"ps0.pt", "ps1.pt", "ctr0.pt", "ctr1.pt"}
        model = manifest["meta"]["model"]
        sizes = model["criteo"]["cardinalities"]
        assert len(sizes) == 26 and sum(sizes) < 400_000, model                  # at RPCPS_CTR_SCALE
        assert model["criteo"]["hashed"] == [2, 3], model                          # C3 and C4
        assert [t["name"] for t in model["schema"]["tables"] if t["hashed"]] == ["C3", "C4"], model

        hosts.up(["ctr-export"])
        exported = hosts.procs["ctr-export"]
        assert exported.wait(120) == 0, hosts.log("ctr-export")
        hosts.procs.pop("ctr-export")
        hosts.up(["ctr-serve0"])
        row = {**{f"I{j}": j for j in range(1, 14)}, **{f"C{t}": f"{t:08x}" for t in range(1, 27)}}
        wait_until(lambda: hosts.alive() or _answers(hosts, "http://ctr-serve0:8080/readyz"), 90, "ctr-serve0 ready")
        answer = json.loads(hosts.curl("prometheus", "-f", "-H", "content-type: application/json", "-d",
                                       json.dumps({"rows": [row, dict(row, C3=None)]}),
                                       "http://ctr-serve0:8080/predict"))
        assert len(answer["predictions"]) == 2 and answer["served"]["checkpoint"] == newest_checkpoint(volume).name

        wait_scraped(hosts, f"http://{net.addresses['prometheus']}:9090", [*roles, "ctr-serve0"], {
            "rpcps_trainer_samples_total > 0": {"ctr0", "ctr1"},
            'sum by (name) (rpcps_ps_optimizer_steps_total{cluster="ctr"}) > 0': {"ps0", "ps1"},
            'rpcps_serve_rows_total{cluster="ctr"} > 0': {"serve0"}})

        codes = hosts.down()
        assert all(code == 0 for name, code in codes.items() if name != "prometheus"), codes
    except AssertionError as exc:
        logs = "\n".join(f"--- {n} ---\n{hosts.log(n)}" for n in hosts.order)
        raise AssertionError(f"{exc}\n{logs}") from None
    finally:
        hosts.down()


_RECEIVE = """
import socket, sys, time
s = socket.create_server((sys.argv[1], 9000))
print("listening", flush=True)
c, _ = s.accept()
got, first = 0, None
while data := c.recv(65536):
    first = first or time.monotonic()
    got += len(data)
print(got, time.monotonic() - first, flush=True)
"""
_SEND = "import socket, sys; c = socket.create_connection((sys.argv[1], 9000)); c.sendall(bytes(2 << 20)); c.close()"


def test_a_hosts_link_is_limited_to_its_rate_and_freed(network):
    # What the link sweep of `rpcps bench scale` rests on: 2 MiB out of a host limited to
    # 8 Mbit/s take at least the time the rate allows beyond its 256 KiB burst (1.8 s), and
    # nothing like it once the limit is lifted.
    import sys
    net = network({"a": {}, "b": {}})

    def send() -> tuple[int, float]:
        receiver = subprocess.Popen(net.exec_argv("b", [sys.executable, "-c", _RECEIVE, net.addresses["b"]]),
                                    stdout=subprocess.PIPE, text=True)
        try:
            assert receiver.stdout.readline().strip() == "listening"
            subprocess.run(net.exec_argv("a", [sys.executable, "-c", _SEND, net.addresses["b"]]), check=True,
                           timeout=60)
            got, seconds = receiver.communicate(timeout=60)[0].split()
            return int(got), float(seconds)
        finally:
            receiver.kill()
            receiver.wait()
    net.limit("a", "8mbit")
    got, limited = send()
    assert got == 2 << 20 and limited >= (2 << 20) * 0.85 * 8 / 8e6, limited
    net.limit("a", None)
    got, free = send()
    assert got == 2 << 20 and free < limited / 4, (free, limited)
    with pytest.raises(Unavailable, match="cannot limit"):
        net.limit("a", "fast")

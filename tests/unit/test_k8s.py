"""deploy/k8s/, checked without a cluster: against the Kubernetes schemas, and against the code its
pods run (each pod's expanded command parses with the real CLI into the role name it must have,
every variable is read, probes and scrape annotations meet the sidecar, servers find ps-0 before
anything is ready, and each server shard has a checkpoint volume of its own)."""
from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from supervise import cli
from services.config import env_name, load
from services.sidecar import create_app
from services.workload import roles, settings_of
from tests.support.deploy import K8S, TORCH_VARIABLES, image_env, k8s_pods, k8s_workloads, run, tool
from tests.support.fakes import FakeControl

# The oldest schema kubernetes-validate ships and the newest: the docs' floor (1.25) is the first.
VERSIONS = ("1.25", "1.37")


def resources() -> dict[tuple[str, str], dict]:
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def stub_rpcps(tmp_path_factory) -> Path:
    """An ``rpcps`` on PATH that prints the argv it was given: what a pod's shell really execs."""
    folder = tmp_path_factory.mktemp("bin")
    stub = folder / "rpcps"
    stub.write_text("#!/bin/sh\nexec python3 -c 'import json, sys; print(json.dumps(sys.argv[1:]))' \"$@\"\n")
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    return folder


def executed_argv(command: list[str], pod_env: dict[str, str], stub_folder: Path) -> list[str]:
    env = {"PATH": f"{stub_folder}:{os.environ['PATH']}", **pod_env}
    if command[0] != "rpcps":
        assert command[:2] == ["sh", "-c"] and command[2].startswith("exec rpcps "), command
    r = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def container_env(container: dict) -> dict[str, str]:
    """Literal values; secret and field references count as unset (they are not the config's concern)."""
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


@pytest.mark.parametrize("version", VERSIONS)
def test_manifests_match_the_kubernetes_schemas(version):
    files = [str(p) for p in sorted(K8S.glob("*.yaml"))]
    assert len(files) >= 3
    r = run(tool("kubernetes-validate"), "--strict", "-k", version, *files)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_pod_runs_a_role_the_cli_accepts_under_its_own_name(stub_rpcps):
    names: dict[str, list[str]] = {}
    for pod in k8s_pods():
        container = pod_spec(pod.workload)["containers"][0]
        assert container["image"].startswith("rpcps:")
        env = {**image_env(), **container_env(container)}
        argv = executed_argv(container["command"], pod.env, stub_rpcps)
        args = cli.parse(argv)
        model = settings_of(roles()[args.command], vars(args), env)
        cfg = load(model, vars(args), env)               # raises ConfigError on any bad value
        assert cfg.name == pod.role_name, f"pod {pod.name} runs {cfg.name}"
        names.setdefault(args.command, []).append(cfg.name)
        known = {env_name(f, i) for f, i in model.model_fields.items()} | TORCH_VARIABLES
        unknown = sorted(k for k in env if (k.startswith("RPCPS_") or k in TORCH_VARIABLES) and k not in known)
        assert not unknown, f"{pod.name}: {unknown} are not read by `rpcps {args.command}`"
        servers = "ctr-ps" if args.command in ("ctr", "serve") or getattr(cfg, "workload", None) == "ctr" else "ps"
        if args.command in ("ps", "trainer", "ctr", "serve"):
            assert cfg.num_ps == k8s_workloads()[servers]["spec"]["replicas"], f"{pod.name}: RPCPS_NUM_PS"
        if args.command in ("trainer", "ctr"):
            assert cfg.num_trainers == pod.workload["spec"]["completions"]
    assert names == {"ps": ["ps0", "ps1", "ps0", "ps1"], "trainer": ["trainer0", "trainer1"], "agent": ["agent"],
                     "observer": ["observer0", "observer1", "observer2", "observer3"], "ctr": ["ctr0", "ctr1"],
                     "serve": ["serve0", "serve1"]}
    agent = pod_spec(k8s_workloads()["agent"])["containers"][0]["command"]
    assert agent[agent.index("--min-observers") + 1] == str(k8s_workloads()["observer"]["spec"]["completions"])


def test_peers_find_the_store_before_anything_is_ready():
    docs = resources()
    for workload_name, service_name in (("ps", "ps"), ("agent", "agent"), ("ctr-ps", "ctr-ps")):
        service = docs[("Service", service_name)]["spec"]
        assert service["clusterIP"] == "None" and service["publishNotReadyAddresses"] is True
        workload = k8s_workloads()[workload_name]
        assert service["selector"].items() <= workload["spec"]["template"]["metadata"]["labels"].items()
        assert 29500 in [p["port"] for p in service["ports"]]
    for servers in ("ps", "ctr-ps"):
        spec = k8s_workloads()[servers]["spec"]
        assert spec["serviceName"] == servers and spec["podManagementPolicy"] == "Parallel"
    selectors = [w["spec"]["selector"]["matchLabels"] for w in k8s_workloads().values() if "selector" in w["spec"]]
    for w in k8s_workloads().values():      # no controller's selector takes another's pods
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert sum(s.items() <= labels.items() for s in selectors) <= 1, w["metadata"]["name"]
    for name, workload in k8s_workloads().items():
        env = container_env(pod_spec(workload)["containers"][0])
        # pod 0's DNS name under the Service
        leader = {"agent": "agent", "observer": "agent", "ctr-ps": "ctr-ps-0.ctr-ps", "ctr": "ctr-ps-0.ctr-ps",
                  "ctr-serve": "ctr-ps-0.ctr-ps"}.get(name, "ps-0.ps")
        assert env["MASTER_ADDR"] == leader and env["MASTER_PORT"] == "29500", name
        assert env["TP_SOCKET_IFNAME"] == "eth0", f"{name}: TensorPipe would advertise loopback"


@pytest.mark.parametrize("servers", ["ps", "ctr-ps"])
def test_each_server_shard_has_its_own_checkpoint_volume(servers):
    ps = k8s_workloads()[servers]
    templates = {t["metadata"]["name"]: t for t in ps["spec"]["volumeClaimTemplates"]}
    mount = {m["name"]: m["mountPath"] for m in pod_spec(ps)["containers"][0]["volumeMounts"]}
    assert set(templates) == set(mount) and mount["checkpoints"] == image_env()["RPCPS_CHECKPOINT_DIR"]
    assert "ReadWriteOnce" in templates["checkpoints"]["spec"]["accessModes"]
    assert pod_spec(ps)["securityContext"]["fsGroup"] == 10001     # the image's user can write the volume
    agent = pod_spec(k8s_workloads()["agent"])
    assert agent["containers"][0]["volumeMounts"][0]["mountPath"] == image_env()["RPCPS_CHECKPOINT_DIR"]
    assert k8s_workloads()["agent"]["spec"]["strategy"]["type"] == "Recreate"


def test_probes_ports_annotations_and_token_meet_the_sidecar():
    routes = {r.path for r in create_app(FakeControl(), CollectorRegistry(), None).routes}
    port = int(image_env()["RPCPS_SIDECAR_PORT"])
    for name, workload in k8s_workloads().items():
        container = pod_spec(workload)["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["sidecar"] == port, name
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            get = container[probe]["httpGet"]
            assert get["path"] in routes and get["port"] in ("sidecar", port), (name, probe)
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true" and int(annotations["prometheus.io/port"]) == port
        assert annotations["prometheus.io/path"] in routes
        token = next(e for e in container["env"] if e["name"] == "RPCPS_CONTROL_TOKEN")
        assert "value" not in token and token["valueFrom"]["secretKeyRef"]["name"] == "rpcps-control"
        assert not token["valueFrom"]["secretKeyRef"].get("optional"), f"{name} would start without a token"
        assert pod_spec(workload)["securityContext"]["runAsNonRoot"] is True
        assert pod_spec(workload)["terminationGracePeriodSeconds"] >= 20, "room for the final checkpoint"


def test_only_rpcps_pods_reach_the_store_and_rpc_ports_and_prometheus_only_the_sidecars():
    policy = resources()[("NetworkPolicy", "rpcps")]["spec"]
    selected = policy["podSelector"]["matchLabels"]
    for name, workload in k8s_workloads().items():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert selected.items() <= labels.items(), f"{name}'s pods are not under the policy"
    assert policy["policyTypes"] == ["Ingress"]
    rules = policy["ingress"]
    assert all(rule.get("from") for rule in rules), "a rule without 'from' admits everyone"
    open_ports = [rule for rule in rules if "ports" not in rule]
    assert [r["from"] for r in open_ports] == [[{"podSelector": {"matchLabels": selected}}]], \
        "every port (store, RPC) only from rpcps pods"
    for rule in rules:
        if "ports" in rule:
            assert [p["port"] for p in rule["ports"]] == ["sidecar"], rule
            assert all(peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
                       for peer in rule["from"]), rule
    # Clients of /predict reach the serving members' sidecar port, and nothing else of anything.
    predict = resources()[("NetworkPolicy", "rpcps-predict")]["spec"]
    served = [n for n, w in k8s_workloads().items()
              if predict["podSelector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
    assert served == ["ctr-serve"] and [[p["port"] for p in r["ports"]] for r in predict["ingress"]] == [["sidecar"]]
    for name, workload in k8s_workloads().items():      # the named port the rule admits is the sidecar's
        ports = {p["name"]: p["containerPort"] for p in pod_spec(workload)["containers"][0]["ports"]}
        assert ports["sidecar"] == int(image_env()["RPCPS_SIDECAR_PORT"]), name


def test_the_image_is_named_in_one_place():
    kustomization = yaml.safe_load((K8S / "kustomization.yml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in K8S.glob("*.yaml"))
    [image] = kustomization["images"]
    images = {c["image"].split(":")[0] for w in k8s_workloads().values() for c in pod_spec(w)["containers"]}
    assert images == {image["name"]}, "every container's image is the one kustomization.yml rewrites"

"""What the deployment artefacts say a container runs: the compose file's services, the image's
environment, and a service's command as the process it becomes (used by the static checks and by
the multi-host run in network namespaces)."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
PROMETHEUS = REPO / "deploy" / "prometheus.yml"


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]'; promtool: Debian's prometheus)")
    return path


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def rpcps_services() -> dict[str, dict]:
    """The services that run an rpcps role (not a one-shot command such as `export`)."""
    return {n: s for n, s in compose()["services"].items() if s.get("image", "").startswith("rpcps")
            and s["command"][0] not in ONE_SHOT}


ONE_SHOT = ("export",)      # rpcps commands a service runs once, to completion


def image_env() -> dict[str, str]:
    """The ENV lines of the Dockerfile; a variable they extend (``PATH=/opt/rpcps/bin:$PATH``)
    extends this machine's."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            for item in shlex.split(line[4:]):
                key, _, value = item.partition("=")
                env[key] = os.path.expandvars(value)
    return env


class ComposeRefuses(Exception):
    """What ``docker compose`` stops on: a required variable is not set."""


def interpolate(value: str, environ: dict[str, str]) -> str:
    """Compose's ``${VAR:-default}`` (the variable if set and not empty, else the default) and
    ``${VAR:?message}`` (the variable, or compose refuses to start with the message)."""
    def one(m: re.Match) -> str:
        name, kind, word = m.groups()
        if environ.get(name):
            return environ[name]
        if kind == "?":
            raise ComposeRefuses(f"required variable {name} is missing a value: {word}")
        return word
    return re.sub(r"\$\{([A-Z_]+):([-?])([^}]*)\}", one, value)


def service_env(service: dict, environ: dict[str, str] | None = None) -> dict[str, str]:
    """What the container sees: the image's ENV, then the service's, interpolated from ``environ``
    (the shell or ``.env`` of ``docker compose up``; default: nothing set)."""
    env = dict(image_env())
    for key, value in (service.get("environment") or {}).items():
        env[key] = interpolate(str(value), environ or {})
    return env


# Variables read by something other than rpcps's configuration: torch's rendezvous and transports.
TORCH_VARIABLES = {"MASTER_ADDR", "MASTER_PORT", "TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"}


def mounts(service: dict, volumes: Path) -> dict[str, Path]:
    """Path inside the container -> where it is here: a bind mount's source (relative to the
    compose file), or a named volume's folder under ``volumes``."""
    out = {}
    for spec in service.get("volumes") or []:
        source, target = str(spec).split(":")[:2]
        out[target] = (COMPOSE.parent / source).resolve() if source.startswith((".", "/")) else volumes / source
    return out


def host_process(service: dict, volumes: Path, environ: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of what a service's container runs, as a plain process here: the
    rpcps image's ENTRYPOINT is ``rpcps``, Prometheus's is its binary; container paths of mounts
    become their folders here. ``environ`` is what compose interpolates ``${...}`` from."""
    where = mounts(service, volumes)

    def mapped(value: str) -> str:
        flag, eq, path = value.rpartition("=") if value.startswith("--") else ("", "", value)
        for target, here in where.items():
            if path == target or path.startswith(target + "/"):
                return f"{flag}{eq}{here}{path[len(target):]}"
        return value

    command = [mapped(str(a)) for a in service.get("command") or []]
    image = interpolate(service.get("image", ""), environ)
    if image.startswith("rpcps"):
        argv = [sys.executable, "-m", "supervise.cli", *command]
        env = {k: mapped(v) for k, v in service_env(service, environ).items()}
    elif image.startswith("prom/prometheus"):
        argv, env = [shutil.which("prometheus") or "prometheus", *command], {}
    else:
        raise ValueError(f"no local stand-in for image {image!r}")
    base = {k: v for k, v in os.environ.items() if not k.startswith("RPCPS_") and k not in TORCH_VARIABLES}
    for here in where.values():
        if not here.exists():
            here.mkdir(parents=True)
    return argv, {**base, **env}


def start_order(services: dict[str, dict]) -> list[str]:
    """The services in an order that starts every ``depends_on`` target first, as compose does."""
    done: list[str] = []

    def visit(name: str, seen: tuple[str, ...] = ()) -> None:
        if name in done:
            return
        if name in seen:
            raise ValueError(f"depends_on cycle through {name}")
        for dep in services[name].get("depends_on") or {}:
            visit(dep, (*seen, name))
        done.append(name)

    for name in services:
        visit(name)
    return done


K8S = REPO / "deploy" / "k8s"


def _label_name(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


@dataclass
class Pod:
    """One pod of a deploy/k8s workload, as Kubernetes would create it."""
    name: str                       # the pod's name (ps-1)
    role_name: str                  # the rpcps role it must run as (ps1; ps1 for ctr-ps-1 too)
    env: dict[str, str]             # what the Downward API and the Job controller set
    index_labels: dict[str, str]    # the labels Kubernetes adds with the pod's index
    workload: dict

    @property
    def service(self) -> str:
        """The compose service that runs the same member (ps1, ctr-ps1, trainer1, agent)."""
        index = self.index_labels.get("apps.kubernetes.io/pod-index",
                                      self.index_labels.get("batch.kubernetes.io/job-completion-index", ""))
        return self.workload["metadata"]["name"] + index


def k8s_workloads() -> dict[str, dict]:
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc["kind"] in ("StatefulSet", "Deployment", "Job"):
                out[doc["metadata"]["name"]] = doc
    return out


def k8s_pods() -> list[Pod]:
    pods = []
    for name, doc in k8s_workloads().items():
        spec = doc["spec"]
        if doc["kind"] == "StatefulSet":
            # A second cluster's servers (ctr-ps-1) are ps1 of their own group.
            pods += [Pod(f"{name}-{i}", f"{name.split('-')[-1]}{i}", {"POD_NAME": f"{name}-{i}", "HOSTNAME": f"{name}-{i}"},
                         {"apps.kubernetes.io/pod-index": str(i)}, doc) for i in range(spec["replicas"])]
        elif spec.get("completionMode") == "Indexed":
            pods += [Pod(f"{name}-{i}-x1y2z", f"{name}{i}", {"POD_NAME": f"{name}-{i}-x1y2z", "JOB_COMPLETION_INDEX": str(i)},
                         {"batch.kubernetes.io/job-completion-index": str(i)}, doc) for i in range(spec["completions"])]
        else:
            pods += [Pod(f"{name}-7d9f8-x1y2z", name, {"POD_NAME": f"{name}-7d9f8-x1y2z"}, {}, doc)
                     for _ in range(spec.get("replicas", 1))]
    return pods


def k8s_pod_targets(addresses: dict[str, str], namespace: str = "default") -> list[dict]:
    """What Prometheus's Kubernetes pod discovery would list for deploy/k8s's pods, in file_sd form:
    one target per declared container port, with the pod's labels, annotations and index. A pod is
    placed at ``addresses[<its compose service's name>]``; pods without an address are not running."""
    targets = []
    for pod in k8s_pods():
        if pod.service not in addresses:
            continue
        template = pod.workload["spec"]["template"]
        meta = {"__meta_kubernetes_namespace": namespace, "__meta_kubernetes_pod_name": pod.name}
        for key, value in {**template["metadata"].get("labels", {}), **pod.index_labels}.items():
            meta[f"__meta_kubernetes_pod_label_{_label_name(key)}"] = value
        for key, value in template["metadata"].get("annotations", {}).items():
            meta[f"__meta_kubernetes_pod_annotation_{_label_name(key)}"] = value
        for port in template["spec"]["containers"][0]["ports"]:
            targets.append({"targets": [f"{addresses[pod.service]}:{port['containerPort']}"],
                            "labels": {**meta, "__meta_kubernetes_pod_container_port_name": port["name"]}})
    return targets


def k8s_prometheus_config(targets_file: Path) -> dict:
    """deploy/k8s/prometheus.yml with pod discovery read from ``targets_file`` instead of the
    Kubernetes API (Debian's Prometheus is built without Kubernetes discovery); all else as shipped."""
    config = yaml.safe_load((K8S / "prometheus.yml").read_text())
    for job in config["scrape_configs"]:
        assert [sd["role"] for sd in job.pop("kubernetes_sd_configs")] == ["pod"]
        job["file_sd_configs"] = [{"files": [str(targets_file)], "refresh_interval": "5s"}]
    return config

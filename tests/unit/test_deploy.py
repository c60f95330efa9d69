"""The deployment artefacts, checked without a container engine: against their schemas and linters,
and against the code they start (commands, variables, paths, ports)."""
import json
import re

import pytest
import yaml
from prometheus_client import CollectorRegistry

from supervise import cli
from services.config import env_name, load
from services.sidecar import create_app
from services.workload import roles, settings_of
from tests.support.deploy import (COMPOSE, DOCKERFILE, PROMETHEUS, REPO, TORCH_VARIABLES, ComposeRefuses, compose,
                                  image_env, interpolate, rpcps_services, run, service_env, tool)
from tests.support.fakes import FakeControl


def test_compose_file_matches_the_compose_specification():
    r = run(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(COMPOSE))
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfile_passes_hadolint():
    r = run(tool("hadolint"), "--no-color", str(DOCKERFILE))
    assert r.returncode == 0, r.stdout + r.stderr


def test_prometheus_config_rules_and_rule_tests_pass_promtool():
    promtool = tool("promtool")
    for argv in (["check", "config", str(PROMETHEUS)], ["check", "rules", str(REPO / "deploy" / "alerts.yml")],
                 ["test", "rules", str(REPO / "deploy" / "alerts_test.yml")]):
        r = run(promtool, *argv)
        assert r.returncode == 0, f"promtool {' '.join(argv)}:\n{r.stdout}{r.stderr}"


def test_every_compose_command_and_variable_is_one_the_cli_accepts():
    services = rpcps_services()
    assert {"ps0", "ps1", "trainer0", "trainer1", "agent", "observer0", "ctr-ps0", "ctr0"} <= set(services)
    for name, service in services.items():
        argv = [str(a) for a in service["command"]]
        args = cli.parse(argv)            # the image's ENTRYPOINT is `rpcps`
        env = service_env(service, {"RPCPS_CONTROL_TOKEN": "t0ken"})
        model = settings_of(roles()[args.command], vars(args), env)
        cfg = load(model, vars(args), env)                 # raises ConfigError on any bad value
        # A second cluster's servers are ps0, ps1 of their own group, under a prefixed service name.
        assert cfg.name == name.split("-")[-1], f"service {name} runs a role named {cfg.name}"
        known = {env_name(f, i) for f, i in model.model_fields.items()} | TORCH_VARIABLES
        unknown = sorted(k for k in env if (k.startswith("RPCPS_") or k in TORCH_VARIABLES) and k not in known)
        assert not unknown, f"{name}: {unknown} are not read by `rpcps {args.command}`"
        assert cfg.sidecar_host == "0.0.0.0" and str(cfg.checkpoint_dir) == "/checkpoints"
        workload = getattr(cfg, "workload", None) or args.command
        leader = {"agent": "agent", "observer": "agent", "ctr": "ctr-ps0"}.get(workload, "ps0")
        if workload == "serve":         # from an exported folder: it joins no group
            assert "MASTER_ADDR" not in env and cfg.snapshot is not None, name
            continue
        assert env["MASTER_ADDR"] == leader and leader in services, f"{name} looks for its store at {env['MASTER_ADDR']}"


def test_the_serving_profile_exports_the_ctr_clusters_checkpoints_into_what_it_serves():
    everything = compose()["services"]
    export, serve = everything["ctr-export"], everything["ctr-serve0"]
    args = cli.parse([str(a) for a in export["command"]])
    assert args.command == "export" and args.replace
    volumes = {v.split(":")[1]: v.split(":")[0] for v in export["volumes"]}
    assert volumes[str(args.checkpoint)] == "ctr-checkpoints" == everything["ctr-ps0"]["volumes"][0].split(":")[0]
    served = {v.split(":")[1]: v.split(":")[0] for v in serve["volumes"]}
    assert served["/models"] == volumes["/models"] and vars(cli.parse(serve["command"]))["snapshot"] == str(args.out)
    assert serve["depends_on"] == {"ctr-export": {"condition": "service_completed_successfully"}}


def test_health_checks_scrapes_and_ports_meet_the_sidecar():
    routes = {r.path for r in create_app(FakeControl(), CollectorRegistry(), None).routes}
    env = image_env()
    port = int(env["RPCPS_SIDECAR_PORT"])
    healthcheck = re.search(r"HEALTHCHECK .*?http://127\.0\.0\.1:(\d+)(/[a-z]+)", DOCKERFILE.read_text(), re.S)
    assert healthcheck and int(healthcheck.group(1)) == port and healthcheck.group(2) in routes
    scrape = yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"][0]
    assert scrape["metrics_path"] in routes
    targets = scrape["dns_sd_configs"][0]
    assert targets["port"] == port
    services = rpcps_services()
    assert set(targets["names"]) == set(services), "every role is scraped, and nothing else"
    published = []
    for name, service in services.items():
        for mapping in service["ports"]:
            address, host, container = interpolate(str(mapping), {}).split(":")
            assert int(container) == port, f"{name} publishes {container}, the sidecar listens on {port}"
            assert address == "127.0.0.1", f"{name} is published beyond this machine by default"
            published.append(int(host))
        assert "29500" not in json.dumps(service.get("ports")), f"{name} publishes the RPC store"
    assert len(published) == len(set(published)), "two services publish the same host port"
    prometheus = compose()["services"]["prometheus"]
    mounted = {v.split(":")[1] for v in prometheus["volumes"]}
    assert "/etc/prometheus/prometheus.yml" in mounted and "/etc/prometheus/alerts.yml" in mounted
    assert [interpolate(p, {}).split(":")[0] for p in prometheus["ports"]] == ["127.0.0.1"]
    assert not any("lifecycle" in str(a) for a in prometheus["command"]), "its lifecycle API would be open"


def test_the_token_comes_from_the_environment_never_the_image_and_is_required():
    assert "RPCPS_CONTROL_TOKEN" not in image_env()
    for name, service in rpcps_services().items():
        with pytest.raises(ComposeRefuses, match="RPCPS_CONTROL_TOKEN"):
            service_env(service, {})                        # compose refuses to start without one
        assert service_env(service, {"RPCPS_CONTROL_TOKEN": "s3cret"})["RPCPS_CONTROL_TOKEN"] == "s3cret", name
    assert ".env" in (REPO / ".dockerignore").read_text().split()
    assert re.search(r"^RPCPS_CONTROL_TOKEN=$", (REPO / ".env.example").read_text(), re.M)


def exported_metric_names() -> set[str]:
    """Every series name an rpcps role can export (all role families initialised)."""
    from ps.server.metrics import PsMetrics
    from ps.server.service import ParameterServer
    from services.remote import remote_methods
    from trainer.lm.metrics import TrainerMetrics
    from trainer.ctr.serving.status import ServeMetrics
    from trainer.rl.metrics import RlMetrics
    registries = [CollectorRegistry() for _ in range(4)]     # one per kind of role, as in their processes
    ps = PsMetrics(registries[0], "ps", "ps0")
    ps.init_ps(remote_methods(ParameterServer))
    ps.hashed({"C1": dict.fromkeys(("rows", "capacity", "admitted", "evicted", "dropped"), 1)}, 0)   # by table
    TrainerMetrics(registries[1], "trainer", "trainer0")
    RlMetrics(registries[2], "agent", "agent")
    ServeMetrics(registries[3], "serve", "serve0")
    return {sample.name for registry in registries for family in registry.collect() for sample in family.samples}


def test_grafana_dashboard_queries_are_valid_promql_over_real_series(tmp_path):
    dashboard = json.loads((REPO / "deploy" / "grafana" / "rpcps.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    known = exported_metric_names()
    for expr in exprs:
        missing = sorted(set(re.findall(r"\brpcps_[a-z_]+", expr)) - known)
        assert not missing, f"{expr!r} queries {missing}, which no role exports"
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:panel{i}", "expr": e}
                                                         for i, e in enumerate(exprs)]}]}
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    r = run(tool("promtool"), "check", "rules", str(path))        # parses every expression
    assert r.returncode == 0, r.stdout + r.stderr


def test_alert_rules_query_real_series():
    known = exported_metric_names() | {"up"}
    rules = yaml.safe_load((REPO / "deploy" / "alerts.yml").read_text())["groups"][0]["rules"]
    for rule in rules:
        names = set(re.findall(r"\b(rpcps_[a-z_]+|process_[a-z_]+|up)\b(?=[{\[\s)]|$)", rule["expr"]))
        assert names and names <= known, f"{rule['alert']}: {sorted(names - known)} are not exported"


def test_the_image_holds_every_package_the_project_installs():
    import tomllib
    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in include}
    on_disk = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests"}
    assert packages == on_disk, "pyproject.toml installs other packages than the repository has"
    text = DOCKERFILE.read_text()
    copied = set(re.findall(r"^COPY (\w+) \./(\w+)$", text, re.M))
    assert copied == {(p, p) for p in packages}, "the image must copy every package"



def test_the_image_installs_its_pinned_dependencies_before_the_sources_one_index_a_step():
    import tomllib

    from packaging.requirements import Requirement
    text = DOCKERFILE.read_text()
    copies = re.findall(r"^COPY (.+) \./", text, re.M)
    assert copies[0] == "requirements.lock", "the dependency layer must depend on the pinned list alone"
    first_source = text.index("COPY pyproject.toml")
    assert text.index("-r requirements.lock") < first_source and "--extra-index-url" not in text
    assert re.search(r'--no-deps --index-url "\$TORCH_INDEX" .*\^torch==', text), "torch comes from TORCH_INDEX alone"
    assert re.search(r'--index-url "\$PIP_INDEX" -r requirements.lock', text), "the rest from PIP_INDEX"
    assert re.search(r'--no-index --find-links "/context/\$WHEELS" -r requirements.lock', text), "WHEELS: no index"
    pins = dict(line.split("==") for line in (REPO / "requirements.lock").read_text().splitlines()
                if line and not line.startswith("#"))
    for dependency in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]:
        req = Requirement(dependency)
        name = req.name.lower().replace("_", "-")
        assert name in pins and req.specifier.contains(pins[name]), f"requirements.lock: {name} {pins.get(name)} " \
                                                                    f"does not satisfy {dependency}: python -m tools.lock"

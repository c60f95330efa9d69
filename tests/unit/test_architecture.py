"""Architecture rules, written as tests so they stay true."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("services", "supervise", "ps", "trainer", "rpcps")

# The seams: only these may touch torch RPC / distributed autograd directly.
RPC_SEAMS = {
    "services/rpc.py",          # init_rpc / shutdown
    "services/remote.py",       # the one remote-call mechanism every surface uses
    "services/membership.py",   # the group's membership (private torch internals)
    "ps/server/contexts.py",           # the server side of the PS interface: its callers' autograd contexts
    "ps/client/session.py",            # the client side of the PS interface: a step's distributed autograd
    "trainer/lm/bench_seed.py",   # the seed design, kept verbatim as the benchmark's baseline
}
RPC_MODULES = {"torch.distributed.rpc", "torch.distributed.autograd", "torch.distributed.optim"}
# Raw calls to another member: the mechanism itself, membership's bootstrap (liveness probes,
# before any service answers), and the seed's design as written.
RAW_CALL_SEAMS = {"services/remote.py", "services/membership.py", "trainer/lm/bench_seed.py"}
RAW_CALLS = {"rpc_async", "rpc_sync", "remote"}
# Where the remote method goes in the calls that take one: call(to, method, ...), ask_coordinator(method, ...).
METHOD_ARGUMENT = {"call": 1, "call_async": 1, "ask": 1, "ask_coordinator": 0}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def sources():
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            yield path.relative_to(REPO).as_posix(), path


def test_only_the_seams_use_torch_rpc():
    offenders = {rel for rel, path in sources() if imported_modules(path) & RPC_MODULES and rel not in RPC_SEAMS}
    assert not offenders, f"RPC used outside the seam modules: {sorted(offenders)}"


def test_raw_rpc_calls_only_in_the_mechanism():
    offenders = {}
    for rel, path in sources():
        calls = [n.func.attr for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in RAW_CALLS
                 and isinstance(n.func.value, ast.Name) and n.func.value.id == "rpc"]
        if calls and rel not in RAW_CALL_SEAMS:
            offenders[rel] = calls
    assert not offenders, f"raw RPC calls outside services/remote.py: {offenders}"


def test_remote_methods_are_named_by_the_method_not_a_string():
    # call/call_async take the method object: a string where it belongs is a dispatch by name.
    offenders = []
    for rel, path in list(sources()) + [(p.relative_to(REPO).as_posix(), p) for p in (REPO / "tests").rglob("*.py")]:
        for n in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))):
                continue
            position = METHOD_ARGUMENT.get(n.func.id if isinstance(n.func, ast.Name) else n.func.attr)
            if (position is not None and len(n.args) > position and isinstance(n.args[position], ast.Constant)
                    and isinstance(n.args[position].value, str)):
                offenders.append(f"{rel}:{n.lineno}")
    assert not offenders, f"remote methods named by a string: {offenders}"


def test_services_know_no_workload_and_no_server():
    # Workloads and roles reach the CLI, the launcher and the benches through the registry
    # (services/workload.py, entry points in pyproject.toml), not by import, not even a lazy one.
    offenders = {rel: sorted(m for m in imported_modules(path) if m.split(".")[0] in ("ps", "trainer"))
                 for rel, path in sources() if rel.startswith(("services/", "supervise/"))}
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_the_members_runtime_knows_no_supervisor():
    # A member runs on services/ and ps/ the same under rpcps up, compose, Kubernetes or by hand:
    # what supervises it (supervise/) is above it, never imported by it, not even lazily. The
    # entry points (`python -m ps`) hand over to the command line, which is the supervisor's.
    offenders = {rel: sorted(m for m in imported_modules(path) if m.split(".")[0] == "supervise")
                 for rel, path in sources() if rel.startswith(("services/", "ps/")) and rel != "ps/__main__.py"}
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_workloads_are_registered_and_their_specs_import_no_torch():
    import subprocess
    import sys
    code = ("import sys; from services.workload import workloads, roles, benches; "
            "w = workloads(); [b.load() for b in benches().values()]; "
            "print(sorted(w), sorted(roles()), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert out.split() == ["['ctr',", "'lm',", "'rl']", "['agent',", "'ctr',", "'observer',", "'ps',", "'serve',", "'trainer']",
                           "False"], out


def test_a_workload_imports_no_other_workload():
    # What trainers share lives in trainer/core/; a workload's folder is its own.
    offenders = {}
    for rel, path in sources():
        parts = rel.split("/")
        if parts[0] != "trainer" or len(parts) < 3:
            continue
        mine = parts[1]
        foreign = sorted(m for m in imported_modules(path)
                         if m.startswith("trainer.") and m.split(".")[1] not in (mine, "core"))
        if foreign or (mine == "core" and any(m.startswith("trainer.") and not m.startswith("trainer.core")
                                              for m in imported_modules(path))):
            offenders[rel] = foreign or sorted(imported_modules(path))
    assert not offenders, offenders


def test_main_modules_only_delegate():
    # torch RPC pickles functions by module path: nothing callable may be defined in __main__.
    for pkg in ("ps", "trainer"):
        tree = ast.parse((REPO / pkg / "__main__.py").read_text())
        assert not [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))], pkg


def test_no_print_in_roles():
    # Logging only; printing is for the CLI's and the benchmark's own output.
    allowed = {"supervise/cli.py", "supervise/launcher.py", "supervise/chaos.py"}   # commands with output of their own
    for rel, path in sources():
        # A benchmark prints its JSON, a data writer (`rpcps data`) its summary, a data check its
        # table, an export what it wrote.
        if rel in allowed or rel.rsplit("/", 1)[-1].startswith(("bench", "datagen", "datacheck", "export")):
            continue
        calls = [n for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "print"]
        assert not calls, f"print() in {rel}"


def test_the_parameter_server_knows_no_workload():
    offenders = {rel: sorted(m for m in imported_modules(path) if m.split(".")[0] == "trainer")
                 for rel, path in sources() if rel.startswith("ps/")}
    assert not {k: v for k, v in offenders.items() if v}, offenders


# Words a workload's settings or status use that shared code also uses in their ordinary sense.
SHARED_WORDS = {
    "step": "the cluster's step: checkpoints and the servers' update counter",
    "steps": "the HTTP API's episode body ({\"steps\": N}) and counts of steps",
    "episode": "the HTTP API's episode routes", "episodes": "the HTTP API's episode body ({\"episodes\": N})",
    "id": "checkpoint ids", "model": "what a server hosts (its ModelSpec's meta)",
    "optimizer": "the update rule (a ModelSpec names its optimizer)", "lr": "the update rule's learning rate",
    "loss": "the step protocol (StepSession.finish)", "clip": "the step protocol's gradient clipping",
    "grad_norm": "the step protocol's result", "data": "file contents", "env": "environment variables",
    "start": "threads", "done": "events", "finished": "events", "moved": "events (a change of layout ended)",
    "placement": "a table's placement over the servers (ps/spec/model.py)", "top": "the top of a stack or listing",
    "dim": "a tensor's dimension", "checkpoint": "the cluster's checkpoints (services/checkpoint/)",
    "source": "where a thing comes from", "snapshot": "a copy of state at one moment",
    "serve": "serving an RPC surface (services/remote.py)", "cache": "functools.cache",
    "staleness": "how old a read may be (ssp's bound, a cache's)", "scale": "scaling a tensor (an update rule's factor)",
    "hits": "a cache's (ps/client/cache.py)", "misses": "a cache's, a membership probe's",
    "lookups": "a step's requests for rows (ps/client/lookups.py), and a cache's count of them",
    "backward": "a step's phase (ps/client/session.py), and where a CTR trainer runs it",
}


def test_nothing_outside_a_workload_names_its_settings_or_status_keys():
    # A workload's own names: fields of its settings and /status declared only in its folder.
    from services.workload import resolve, roles, workloads
    declared: dict[str, set[str]] = {}          # field -> the modules of the classes declaring it
    shared = [m for r in roles().values() if r.hosting for m in (r.config, r.status)]   # the servers'
    for spec in workloads().values():
        hosted = [resolve(spec.server.settings)] if spec.server else []
        for model in [spec.up, *hosted, *shared] + [r.config for r in spec.roles] + [r.status for r in spec.roles]:
            for info_model in [model, *(m for i in model.model_fields.values() for m in _models_in(i.annotation))]:
                for cls in info_model.__mro__:
                    for field in getattr(cls, "__annotations__", {}):
                        declared.setdefault(field, set()).add(cls.__module__)
    owned = {field: modules.pop().split(".")[1] for field, modules in declared.items()
             if all(m.startswith("trainer.") for m in modules) and len({m.split(".")[1] for m in modules}) == 1
             and field not in SHARED_WORDS}
    assert {"emsize", "bptt", "ntoken", "observers", "running_reward", "loss_avg", "tokens_per_s"} <= owned.keys(), owned
    offenders = []
    for rel, path in sources():
        if not rel.startswith(("services/", "ps/")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                    else node.arg if isinstance(node, (ast.arg, ast.keyword)) and node.arg
                    else node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None)
            if name in owned:
                offenders.append(f"{rel}:{node.lineno} {name!r} ({owned[name]})")
    assert not offenders, offenders


def _models_in(annotation) -> list[type]:
    import typing
    from pydantic import BaseModel
    return [a for a in (annotation, *typing.get_args(annotation)) if isinstance(a, type) and issubclass(a, BaseModel)]


def test_one_process_wide_registry():
    # RPC entry points reach the objects they act on through services/remote.py's one registry;
    # no module keeps an instance of its own class at module level for them (the old slots).
    offenders = []
    for rel, path in sources():
        tree = ast.parse(path.read_text())
        classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
        for node in tree.body:
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                    and isinstance(node.value.func, ast.Name) and node.value.func.id in classes):
                offenders.append(f"{rel}:{node.lineno}")
    assert offenders == ["services/remote.py:" + str(_line_of("services/remote.py", "_HOSTED = _Hosted()"))], offenders


def _line_of(rel: str, text: str) -> int:
    return next(i for i, line in enumerate((REPO / rel).read_text().splitlines(), 1) if line.startswith(text))


ROLE_MODULES = ("ps/server/role.py", "trainer/core/role.py", "trainer/lm/role.py", "trainer/ctr/role.py", "trainer/rl/agent.py",
                "trainer/rl/observer.py")
COLLABORATORS = {"RpcEndpoint", "Membership", "StatusBoard", "CheckpointStore", "CheckpointMember", "Metrics"}


def test_roles_receive_their_collaborators():
    for rel in ROLE_MODULES:
        built = {n.func.id for n in ast.walk(ast.parse((REPO / rel).read_text()))
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in COLLABORATORS}
        assert not built, f"{rel} builds {built} instead of taking them from its RoleContext"


def test_only_the_checkpoint_package_writes_checkpoints():
    # Participants offer state; where and how it is written is services/checkpoint/'s alone (the
    # checkpoint and embeddings benchmarks measure the store itself).
    writes = {"write_file", "commit", "prune"}
    offenders = []
    for rel, path in sources():
        if rel.startswith("services/checkpoint/") or rel in ("ps/bench.py", "ps/server/hashed/bench.py"):
            continue
        offenders += [f"{rel}:{n.lineno} {n.func.attr}" for n in ast.walk(ast.parse(path.read_text()))
                      if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in writes]
    assert not offenders, offenders


def test_the_clients_parts_depend_on_the_layout_not_on_the_client():
    # The client's parts plan by the routes they are handed (ps/client/routes.py) and call what
    # they are given; only a step (its session and its end), which is its client's, names the
    # client, so nothing imports ps.client.client back in a circle (not even for a type).
    step = {"ps/client/client.py", "ps/client/session.py", "ps/client/step_end.py"}
    offenders = sorted(rel for rel, path in sources() if rel.startswith("ps/client/") and rel not in step
                       and "ps.client.client" in imported_modules(path))
    assert not offenders, offenders


def test_the_trainers_client_imports_no_server():
    # What calls a server names its surface (ps/spec/surface.py): importing the trainers' side of a
    # model must not load the server, nor the compiled loops its hashed tables run on.
    import subprocess
    import sys
    code = ("import sys, ps.client.client, trainer.core.served, trainer.core.loop; "
            "print(sorted(m for m in ('numba', 'ps.server.service', 'ps.server.hashed.index', 'ps.server.tables') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "[]", f"the client loads {loaded.stdout.strip()}"


def test_the_public_api_knows_only_the_servers_declarations():
    # What a user imports (rpcps/, its data plane with it) stands on what a workload declares
    # (ps.spec.model, ps.spec.rules, ps.spec.hashing), never on the client, the server, the services
    # or a workload: not at the top of a module, nor inside a function.
    allowed = {"ps.spec.model", "ps.spec.rules", "ps.spec.hashing", "ps.spec.precision"}
    offenders = {}
    for rel, path in sources():
        if not rel.startswith("rpcps/"):
            continue
        bad = sorted(m for m in imported_modules(path) if m and m.split(".")[0] in ("ps", "trainer", "services", "supervise")
                     and not any(m == a or m.startswith(a + ".") for a in allowed))
        if bad:
            offenders[rel] = bad
    assert not offenders, offenders


def test_the_public_modules_load_no_rpc_trainer_or_server(tmp_path):
    # `import rpcps`, each public module, and a model exported and loaded back (rpcps.load_model,
    # rpcps.batches over a schema's files) load none of the cluster: a serving process or a
    # notebook pays for torch and the model, not for RPC.
    import subprocess
    import sys
    from tests.support.exported import write_exported
    model = write_exported(tmp_path / "model")
    (model / "rows.csv").write_text("label,user_id,movie_id,genres,occupation,age,year\n1,7,3,Drama|War,4,31,1994\n")
    code = (f"import sys, rpcps, rpcps.data, rpcps.model, rpcps.saved, rpcps.quality, rpcps.local; "
            f"m = rpcps.load_model({str(model)!r}); "
            f"next(rpcps.batches(m.schema, {str(model / 'rows.csv')!r}, 4)); "
            f"print(sorted(n for n in sys.modules if n.split('.')[0] in ('trainer', 'services', 'supervise') or "
            f"n.startswith(('ps.client', 'ps.server', 'ps.leader'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                         env={**__import__("os").environ, "PYTHONPATH": f"{REPO}:{tmp_path}"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"the public modules load {out.stdout.strip()}"


def test_the_examples_and_the_builtin_dlrm_are_user_code():
    # The built-in CTR model is written as a user's is: over torch and the public API alone.
    for path in [*(REPO / "examples").rglob("*.py"), REPO / "trainer" / "ctr" / "dlrm.py"]:
        roots = {m.split(".")[0] for m in imported_modules(path)}
        assert roots <= {"torch", "rpcps", "__future__", "typing", "math"}, f"{path.relative_to(REPO)} imports {roots}"


def test_user_code_uses_the_public_api_alone():
    # What a user writes (the examples, the built-in DLRM, the suite's model and queue) names only
    # rpcps.__all__ and rpcps.data.__all__: every other name under rpcps/ is internal.
    import rpcps
    import rpcps.data
    public = {"rpcps": set(rpcps.__all__) | {"data"}, "rpcps.data": set(rpcps.data.__all__)}
    users = [*(REPO / "examples").rglob("*.py"), REPO / "trainer" / "ctr" / "dlrm.py",
             REPO / "tests" / "support" / "queue_source.py", REPO / "tests" / "support" / "ratings_model.py"]
    internal = []
    for path in users:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "rpcps":
                internal += [f"{path.name}: {node.module}.{a.name}" for a in node.names
                             if a.name not in public.get(node.module, set())]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "rpcps":
                internal += [f"{path.name}: rpcps.{node.attr}"] if node.attr not in public["rpcps"] else []
            elif isinstance(node, ast.Import):
                internal += [f"{path.name}: {a.name}" for a in node.names
                             if a.name.startswith("rpcps.") and a.name not in public]
    assert not internal, internal


# The parameter servers' four parts, and what each may import of the others (ps/__init__.py):
# the declarations stand alone, the client and the leader on the declarations, the server on the
# declarations and the leader's clock. The benchmark (ps/bench.py) and `python -m ps` see all.
PS_PARTS = {"spec": {"spec"}, "client": {"spec", "client"}, "leader": {"spec", "leader", "server"},
            "server": {"spec", "server", "leader"}}
# A workload's server-side operations run on a server, inside its call: they may use its parts.
# And `rpcps export` reads the servers' checkpoint files as a server restores them.
SERVER_SIDE = {"trainer/lm/softmax.py", "trainer/ctr/export.py"}


def _ps_part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "ps" else None


def test_the_parameter_servers_parts_keep_their_walls():
    offenders = {}
    for rel, path in sources():
        parts = rel.split("/")
        if parts[0] != "ps" or len(parts) < 3:
            continue
        bad = sorted(m for m in imported_modules(path) if (p := _ps_part(m)) and p not in PS_PARTS[parts[1]])
        if bad:
            offenders[rel] = bad
    assert not offenders, offenders


def test_the_trainers_use_only_the_servers_declarations_and_client():
    offenders = {}
    for rel, path in sources():
        if rel.startswith(("trainer/", "rpcps/")) and rel not in SERVER_SIDE:
            bad = sorted(m for m in imported_modules(path) if _ps_part(m) in ("server", "leader"))
            if bad:
                offenders[rel] = bad
    assert not offenders, offenders


def test_the_data_plane_has_no_import_circle():
    # rpcps/data/: every import between its modules, lazy ones and type checkers' included, runs
    # one way (encoding and the readers below the format registry, statistics above it).
    modules = {f"rpcps.data.{p.stem}": p for p in (REPO / "rpcps" / "data").glob("*.py") if p.stem != "__init__"}
    imports = {m: {d for d in imported_modules(p) if d in modules} for m, p in modules.items()}

    def circle_from(module, path):
        for d in sorted(imports[module]):
            if d in path:
                return [*path[path.index(d):], d]
            found = circle_from(d, [*path, d])
            if found:
                return found
        return None
    circles = [c for m in sorted(modules) if (c := circle_from(m, [m]))]
    assert not circles, " -> ".join(circles[0])


def test_functions_and_classes_keep_to_their_size():
    # A function over 60 lines, or a class over 200, does more than one job: split it (never
    # squeeze comments to fit).
    over = []
    for rel, path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            limit = 60 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else \
                200 if isinstance(node, ast.ClassDef) else None
            if limit is not None and node.end_lineno - node.lineno + 1 > limit:
                over.append(f"{rel}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not over, over

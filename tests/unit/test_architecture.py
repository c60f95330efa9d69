"""Architecture rules, written as tests so they stay true."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("services", "ps", "trainer")

# The seams: only these may touch torch RPC / distributed autograd directly.
RPC_SEAMS = {
    "services/rpc.py",          # init_rpc / shutdown
    "services/membership.py",   # the group's membership (private torch internals)
    "ps/service.py",            # the server side of the PS interface
    "ps/stub.py",               # the client side of the PS interface
    "services/checkpointing.py",  # the checkpoint protocol between ps0 and every member
    "trainer/rl/service.py",    # the RL agent's and observers' interfaces, both sides
    "services/bench/seed.py",   # the seed design, kept verbatim as the benchmark's baseline
}
RPC_MODULES = {"torch.distributed.rpc", "torch.distributed.autograd", "torch.distributed.optim"}


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


def test_main_modules_only_delegate():
    # torch RPC pickles functions by module path: nothing callable may be defined in __main__.
    for pkg in ("ps", "trainer"):
        tree = ast.parse((REPO / pkg / "__main__.py").read_text())
        assert not [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))], pkg


def test_no_print_in_roles():
    # Logging only; printing is for the CLI's and the benchmark's own output.
    allowed = {"services/cli.py", "services/bench/lm.py", "services/bench/seed.py", "services/bench/checkpoint.py",
               "services/bench/rl.py", "services/launcher.py"}
    for rel, path in sources():
        if rel in allowed:
            continue
        calls = [n for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "print"]
        assert not calls, f"print() in {rel}"

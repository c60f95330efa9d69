"""What the trainers' sidecars say of their replicas (``--dense allreduce``), for tests that kill
one and watch the others."""
from services.client import SidecarClient


def agree(urls: dict[str, str], names: list[str], group: list[str], after: int = -1):
    """The step after ``after`` that all of ``names`` took last, once all of them all-reduce in
    ``group``; their replicas' digests must be equal at every step they all took (a difference
    fails at once)."""
    seen = {}
    for name in names:
        with SidecarClient(urls[name], timeout=2.0) as c:
            seen[name] = c.status().get("dense_replica")
    if any(r is None or r["allreduce_group"] != group for r in seen.values()):
        return None
    by_step = [dict(r["digests"]) for r in seen.values()]
    common = set.intersection(*(set(steps) for steps in by_step))
    for step in common:
        assert len({steps[step] for steps in by_step}) == 1, f"replicas differ at step {step}: {seen}"
    return max((s for s in common if s > after), default=None)

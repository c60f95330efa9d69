"""Failpoints (``services/failpoints.py``): read from the environment when the module is first
imported, so each case runs in a fresh interpreter."""
import json
import os
import subprocess
import sys

PROBE = """
import json
from services.failpoints import FailpointError, reached
outcomes = []
for point in ("relayout", "relayout", "adopt"):
    try:
        reached(point)
        outcomes.append("passed")
    except FailpointError as exc:
        outcomes.append(str(exc))
print(json.dumps(outcomes))
"""


def _outcomes(armed: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "RPCPS_FAILPOINTS": armed})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_point_armed_to_fail_fails_every_time_and_others_pass():
    failed = "failed at failpoint relayout (RPCPS_FAILPOINTS)"
    assert _outcomes("relayout!") == [failed, failed, "passed"]
    assert _outcomes("") == ["passed"] * 3

"""Bad input to a server gets a clear error back and leaves the server serving everyone."""
from tests.support.cluster import SMALL_MODEL


def test_bad_requests_get_errors_and_server_keeps_serving(procs):
    ps0, ps1 = procs.start_servers(2, **SMALL_MODEL)
    result = procs.run_driver("bad", "trainer0", 2)

    for case, outcome in result["cases"].items():
        assert outcome["error"] == "BadRequest", f"{case}: {outcome}"
        assert outcome["message"], case
    assert "out of range" in result["cases"]["id past vocab"]["message"]
    assert "does not own" in result["cases"]["id of another shard"]["message"]
    for case in ("too many ids", "too many targets"):      # 262,144 ids: a 200 MB answer, never built
        assert "262144 ids, more than the 65536" in result["cases"][case]["message"], result["cases"][case]
    assert "80000 ids, more than the 65536" in result["cases"]["too many ids in all"]["message"]
    assert "coef must be a float in [0, 1]" in result["cases"]["clip past 1"]["message"]
    assert "must be a tensor [1," in result["cases"]["pushed with the norm, wrong shape"]["message"]
    assert "name a row twice" in result["cases"]["rows held, an id twice"]["message"]
    assert f"must be a float tensor [1, {SMALL_MODEL['emsize']}]" in \
        result["cases"]["rows given back, wrong width"]["message"]
    assert result["good_rows"] == [2, SMALL_MODEL["emsize"]]

    # Still up, healthy and serving a new member after all of that.
    assert ps0.proc.poll() is None and ps1.proc.poll() is None
    with ps0.client() as c:
        assert c.status()["state"] == "running"
        errors = [line for line in c.metrics().splitlines()
                  if line.startswith('rpcps_ps_request_errors_total{') and 'method="lookup"' in line]
        assert errors and float(errors[0].split()[-1]) >= 6
    again = procs.run_driver("bad", "trainer1", 2)
    assert again["good_rows"] == [2, SMALL_MODEL["emsize"]]

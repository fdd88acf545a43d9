"""`retrain serve --load-model`: a hosted endpoint with a known capacity curve, as users start
it (a real serve process): the added wait grows with the requests in flight, and a request
arriving while more than fail_above are in flight gets HTTP 502."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("tinker")

from retrain.serve.guard import LoadModel  # noqa: E402
from tests.run_helpers import read_serve_url  # noqa: E402
from tests.serve_doubles import KEY  # noqa: E402

H = {"X-API-Key": KEY}


def test_load_model_parses_and_follows_the_usl():
    m = LoadModel.parse("base_ms=100, sigma=0.5,kappa=0.25,fail_above=3")
    assert m == LoadModel(100.0, 0.5, 0.25, 3)
    assert m.delay_s(1) == pytest.approx(0.1)
    assert m.delay_s(3) == pytest.approx(0.1 * (1 + 0.5 * 2 + 0.25 * 6))
    assert not m.refuses(4) and m.refuses(5)   # 4 others in flight > 3
    assert LoadModel.parse("").fail_above is None and not LoadModel.parse("").refuses(10**6)
    for bad in ("base_ms", "speed=3", "base_ms=-1", "kappa=nan", "fail_above=2.5",
                "sigma=1,sigma=2"):
        with pytest.raises(ValueError):
            LoadModel.parse(bad)


def _get(url: str, out: list, i: int) -> None:
    t0 = time.monotonic()
    r = httpx.get(f"{url}/api/v1/healthz", headers=H, timeout=30)
    out[i] = (r.status_code, time.monotonic() - t0)


@pytest.fixture
def served(cli_env, python, tmp_path):
    env = {**cli_env, "RETRAIN_SERVE_DIR": str(tmp_path / "state"), "RETRAIN_SERVE_API_KEY": KEY}
    proc = subprocess.Popen([python, "-m", "retrain", "serve", "--model", "tiny-random",
                             "--port", "0", "--dtype", "float32", "--load-model",
                             "base_ms=300,sigma=0,kappa=0.5,fail_above=2"],
                            env=env, stderr=subprocess.PIPE, text=True)
    try:
        yield read_serve_url(proc, 60)
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[1]
        assert proc.returncode in (0, -15) and "Traceback" not in out, out[-2000:]


def test_served_wait_grows_with_in_flight_and_502_above_fail_above(served):
    alone = [None]
    _get(served, alone, 0)
    assert alone[0][0] == 200 and alone[0][1] >= 0.3      # N = 1: base_ms

    got: list = [None] * 4
    threads = [threading.Thread(target=_get, args=(served, got, i)) for i in range(4)]
    for t in threads:          # staggered, so the k-th arrives with k-1 in flight
        t.start()
        time.sleep(0.08)
    for t in threads:
        t.join(30)
    codes = [c for c, _ in got]
    assert codes == [200, 200, 200, 502], got              # 3 others in flight > fail_above = 2
    # N = 3 at arrival: 300 ms * (1 + 0.5 * 3 * 2) = 1.2 s
    assert got[2][1] >= 1.2 and got[3][1] < 1.0, got


def test_bad_load_model_is_one_line_exit_2(cli_env, python):
    proc = subprocess.run([python, "-m", "retrain", "serve", "--model", "tiny-random",
                           "--port", "0", "--load-model", "base_ms=50,kapa=0.1"],
                          env=cli_env, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: --load-model") and "kapa" in lines[0]

"""`retrain serve --load-model`: a hosted endpoint with a known capacity curve, as users start
it (a real serve process): the added wait grows with the requests in flight, and a request
arriving while more than fail_above are in flight gets HTTP 502. Absurd values (a wait of
1e308 ms) are refused; Ctrl-C says what stopping waits for."""

from __future__ import annotations

import queue
import signal
import subprocess
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("tinker")

from retrain.serve.door.guard import LoadModel  # noqa: E402
from tests import warm  # noqa: E402
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
                "sigma=1,sigma=2", "base_ms=1e308", "base_ms=inf", "sigma=1e308", "kappa=2",
                "base_ms=60001"):
        with pytest.raises(ValueError):
            LoadModel.parse(bad)


def _get(url: str, out: list, i: int) -> None:
    t0 = time.monotonic()
    r = httpx.get(f"{url}/api/v1/healthz", headers=H, timeout=30)
    out[i] = (r.status_code, time.monotonic() - t0)


@pytest.fixture
def served(cli_env, python, tmp_path):
    env = {**cli_env, "RETRAIN_SERVE_DIR": str(tmp_path / "state"), "RETRAIN_SERVE_API_KEY": KEY}
    proc = warm.Popen([python, "-m", "retrain", "serve", "--model", "tiny-random",
                       "--port", "0", "--dtype", "float32", "--load-model",
                       "base_ms=2000,sigma=0.25,kappa=0,fail_above=2"],
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
    assert alone[0][0] == 200 and alone[0][1] >= 2.0      # N = 1: base_ms

    got: list = [None] * 4
    threads = [threading.Thread(target=_get, args=(served, got, i)) for i in range(4)]
    for t in threads[:3]:      # three at once: they wait 2 s x (1, 1.25, 1.5) by arrival
        t.start()
    time.sleep(0.7)            # all three still in flight (the shortest takes 2 s)
    threads[3].start()
    for t in threads:
        t.join(30)
    codes = [c for c, _ in got]
    assert codes == [200, 200, 200, 502], got              # 3 others in flight > fail_above = 2
    slowest = max(s for _, s in got[:3])
    assert min(s for _, s in got[:3]) >= 2.0 and slowest >= 3.0, got   # N = 3: 2 s x 1.5
    assert got[3][1] < 1.0, got                            # refused at once


def test_overload_answers_are_counted_from_the_http_log(served, caplog):
    """What the tinker backend counts for max_concurrent = "auto": every 502 httpx receives,
    without printing the INFO lines the logger did not print before."""
    import logging

    from retrain.backends.tinker.overload import HTTP_LOGGER, watch_overload

    logging.getLogger(HTTP_LOGGER).setLevel(logging.WARNING)
    codes: list[int] = []
    f = watch_overload(codes.append)
    try:
        got: list = [None] * 4
        threads = [threading.Thread(target=_get, args=(served, got, i)) for i in range(4)]
        for t in threads[:3]:
            t.start()
        time.sleep(0.7)
        threads[3].start()
        for t in threads:
            t.join(30)
    finally:
        logging.getLogger(HTTP_LOGGER).removeFilter(f)
    assert sorted(codes) == [200, 200, 200, 502], codes
    assert not [r for r in caplog.records if r.name == HTTP_LOGGER]


@pytest.mark.parametrize("value,named", [
    ("base_ms=50,kapa=0.1", "kapa"),
    ("base_ms=1e308,sigma=1e308", "base_ms must be a number from 0 to 60000, got 1e+308"),
])
def test_bad_load_model_is_one_line_exit_2(cli_env, python, value, named):
    proc = warm.run([python, "-m", "retrain", "serve", "--model", "tiny-random",
                     "--port", "0", "--load-model", value],
                    env=cli_env, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: --load-model") and named in lines[0]


def test_ctrl_c_says_what_it_waits_for(cli_env, python, tmp_path):
    """A request held 20 s by the load model: the first Ctrl-C prints one line naming it
    (uvicorn would wait for it in silence), the second stops the server at once."""
    env = {**cli_env, "RETRAIN_SERVE_DIR": str(tmp_path / "state"), "RETRAIN_SERVE_API_KEY": KEY}
    proc = warm.Popen([python, "-m", "retrain", "serve", "--model", "tiny-random",
                       "--port", "0", "--dtype", "float32", "--load-model",
                       "base_ms=20000"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = read_serve_url(proc, 120)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()
        answer: list = [None]
        held = threading.Thread(target=_get_or_error, args=(url, answer), daemon=True)
        held.start()
        time.sleep(1.0)                       # the request sleeps in the load model
        proc.send_signal(signal.SIGINT)
        said = lines.get(timeout=10)
        while said.startswith("retrain serve: the OpenAI-compatible API is at"):  # start-up
            said = lines.get(timeout=10)
        assert said.startswith("retrain serve: stopping; waiting for 1 request in flight"), said
        assert "Ctrl-C again" in said and proc.poll() is None
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=15)                 # not the 19 s the held request has left
        rest = "".join(iter(lambda: _next(lines), ""))
        assert "Traceback" not in rest, rest
        held.join(timeout=10)                 # the held request's connection was dropped
        assert isinstance(answer[0], httpx.TransportError), answer
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _get_or_error(url: str, out: list) -> None:
    """_get, keeping the error of a request whose server went away."""
    try:
        _get(url, out, 0)
    except httpx.TransportError as exc:
        out[0] = exc


def _next(lines: queue.Queue) -> str:
    try:
        return lines.get(timeout=1)
    except queue.Empty:
        return ""

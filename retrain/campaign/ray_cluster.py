"""The one-machine Ray cluster a campaign starts for itself when no cluster is running.

`ray.init()` would start it inside the runner, with a reaper that kills it (and every run on
it) when the runner dies. Instead it is started with `ray start --head` in a session of its
own, so a killed runner leaves its runs going:

- Recorded in the campaign folder (`ray-cluster.json`: address, process group, host, Ray's
  folder), with Ray's output in `ray-cluster.log`.
- Reused by the next runner of the campaign on the same machine (it adopts the runs still
  going there), before any other cluster.
- Stopped, its whole process group, by a runner that ends with nothing of the campaign
  running, unless another campaign's actors are on it (then the runner that ends last stops
  it). A runner killed for good leaves it running with its runs; running the campaign again
  stops it once they are done.
- Its own ports and its own Ray folder (`<tmp>/retrain-ray-<campaign key>`), so it never
  collides with a `ray start` cluster of the user's, and `ray.init()` elsewhere does not
  find it by accident.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from retrain.errors import UserError

RECORD = "ray-cluster.json"
LOG = "ray-cluster.log"
START_TIMEOUT_S = 180.0
STOP_GRACE_S = 5.0


@dataclass
class OwnCluster:
    """A cluster a campaign started: where it answers, and which processes are it."""

    address: str    # host:port of its GCS
    pgid: int       # the process group of every Ray process of it
    host: str       # the machine it runs on
    temp_dir: str   # Ray's folder for it (sessions, sockets, logs)

    def processes(self) -> list[int]:
        """Its processes still alive: the members of its process group, as long as one of
        them is still Ray's for this cluster (a reused group id is someone else's)."""
        members = _group_members(self.pgid)
        if not any(self.temp_dir in _cmdline(pid) for pid in members):
            return []
        return members


def recorded(campaign_dir: Path) -> OwnCluster | None:
    """The campaign's own cluster, if one was started on this machine and still answers."""
    own = _read(Path(campaign_dir) / RECORD)
    if own is None or own.host != socket.gethostname():
        return None
    if not own.processes() or not _answers(own.address):
        _forget(campaign_dir, own)  # stopped or crashed: a stale record
        return None
    return own


def start(campaign_dir: Path, key: str) -> OwnCluster:
    """`ray start --head` in a session of its own; recorded in the campaign folder."""
    campaign_dir = Path(campaign_dir)
    temp_dir = Path(tempfile.gettempdir()) / f"retrain-ray-{key}"
    ports = _free_ports(4)
    command = [_ray_cli(), "start", "--head", f"--port={ports[0]}",
               f"--dashboard-port={ports[1]}", f"--dashboard-agent-listen-port={ports[2]}",
               "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}"]
    if _has_ray_client():  # its server would take port 10001, maybe another cluster's
        command.append(f"--ray-client-server-port={ports[3]}")
    log_path = campaign_dir / LOG
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    own = OwnCluster(address="", pgid=proc.pid, host=socket.gethostname(),
                     temp_dir=str(temp_dir))
    try:
        code = proc.wait(timeout=START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        code = None
    address = _read_address(temp_dir)
    if code != 0 or not address:
        _stop_group(own)
        raise UserError(f"[campaign] executor = \"ray\": no cluster is running, and starting "
                        f"one on this machine failed (`ray start --head`, see {log_path}); "
                        "start one yourself with `ray start --head`, or set "
                        "[campaign] ray_address")
    own.address = address
    tmp = campaign_dir / f".{RECORD}.tmp"
    tmp.write_text(json.dumps(asdict(own), indent=1) + "\n")
    os.replace(tmp, campaign_dir / RECORD)
    return own


def stop(campaign_dir: Path, own: OwnCluster) -> None:
    """Stop the cluster (SIGTERM to its process group, SIGKILL after STOP_GRACE_S) and
    forget it."""
    _stop_group(own)
    _forget(campaign_dir, own)


def _stop_group(own: OwnCluster) -> None:
    if own.processes():  # checked once: the processes named after its folder may go first
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(own.pgid, sig)
            deadline = time.monotonic() + STOP_GRACE_S
            while _group_members(own.pgid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if not _group_members(own.pgid):
                break
    shutil.rmtree(own.temp_dir, ignore_errors=True)


def _forget(campaign_dir: Path, own: OwnCluster) -> None:
    path = Path(campaign_dir) / RECORD
    if _read(path) == own:
        path.unlink(missing_ok=True)


def _read(path: Path) -> OwnCluster | None:
    try:
        data = json.loads(path.read_text())
        return OwnCluster(address=str(data["address"]), pgid=int(data["pgid"]),
                          host=str(data["host"]), temp_dir=str(data["temp_dir"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _read_address(temp_dir: Path) -> str:
    try:
        return (temp_dir / "ray_current_cluster").read_text().strip()
    except OSError:
        return ""


def _ray_cli() -> str:
    here = Path(sys.executable).with_name("ray")
    found = str(here) if here.exists() else shutil.which("ray")
    if not found:
        raise UserError("[campaign] executor = \"ray\": no cluster is running and the `ray` "
                        "command is not installed next to this Python; pip install "
                        "'retrain[ray]', or start a cluster with `ray start --head`")
    return found


def _has_ray_client() -> bool:
    try:
        from ray._private.utils import get_ray_client_dependency_error
    except ImportError:
        return False
    return get_ray_client_dependency_error() is None


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _answers(address: str, timeout_s: float = 2.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def _group_members(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (Linux /proc; elsewhere none are found;
    zombies are not counted: they are gone, only not yet reaped)."""
    members = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return ""

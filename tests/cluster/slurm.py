"""A real, throw-away SLURM on this machine: munged, slurmctld and two slurmd "nodes" (n1, n2).

Used by the ``cluster`` nox session (see noxfile.py)::

    python tests/cluster/slurm.py install          # apt-get the Debian packages if missing
    python tests/cluster/slurm.py start STATE_DIR  # prints the SLURM_CONF to export
    python tests/cluster/slurm.py stop STATE_DIR   # stops exactly the daemons `start` recorded

Everything lives in ``STATE_DIR``: its own munge key and socket (so a munged or SLURM that the machine
already runs is neither used nor disturbed), ``slurm.conf``, spools, logs and pid files. Both nodes
are on 127.0.0.1, each with its own port, spool and pid file (``%n`` in the paths), so
``srun -N 2`` really spans two slurmd. The settings are the ones measured to work without cgroups
or accounting. ``start`` records each daemon's pid in
``pids.json`` as it comes up; ``stop`` signals only those pids, and only while ``/proc`` still shows
the same daemon with this state directory on its command line (a pid can be reused).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PACKAGES = ("slurmd", "slurmctld", "slurm-client", "munge")
BINARIES = ("slurmd", "slurmctld", "srun", "sinfo", "scontrol", "munged", "mungekey")
NODES = ("n1", "n2")
START_TIMEOUT = 30.0
"""Seconds a daemon may take to write its pid file, and the nodes to become idle (about 2 s each here)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def install() -> None:
    """Install the Debian packages unless every binary is already there (about 30-60 s)."""
    if all(shutil.which(name) for name in BINARIES):
        print("slurm and munge are installed")
        return
    missing = [name for name in BINARIES if not shutil.which(name)]
    print(f"installing Debian's {', '.join(PACKAGES)} with apt-get (missing: {', '.join(missing)})", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # Wait for another apt/dpkg run instead of failing at once; a fresh machine needs the lists first.
    apt = ["apt-get", "-q", "-o", "DPkg::Lock::Timeout=300"]
    install_command = [*apt, "install", "-y", "--no-install-recommends", *PACKAGES]
    if any(Path("/var/lib/apt/lists").glob("*_Packages*")):
        if subprocess.run(install_command, env=env, timeout=900).returncode == 0:
            return
        print("apt-get install failed with the package lists on disk (stale?): updating them and trying again")
    subprocess.run([*apt, "update"], check=True, env=env, timeout=600)
    subprocess.run(install_command, check=True, env=env, timeout=900)


def slurm_conf(state: Path, host: str, ports: dict[str, int], munge_socket: Path) -> str:
    nodes = "".join(
        f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={ports[node]} CPUs=2\n" for node in NODES
    )
    return f"""\
# Written by tests/cluster/slurm.py for the fsdp-shim cluster tests; removed with its folder.
ClusterName=fsdpshim
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ports["ctld"]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={state}/ctld
SlurmctldPidFile={state}/slurmctld.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdSpoolDir={state}/spool/%n
SlurmdPidFile={state}/slurmd-%n.pid
SlurmdLogFile={state}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
KillWait=5
{nodes}PartitionName=local Nodes=ALL Default=YES State=UP OverSubscribe=FORCE:4 MaxTime=INFINITE
"""


def wait_for_pid_file(path: Path, log: Path) -> int:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            pid = int(path.read_text().split()[0])
            if Path(f"/proc/{pid}").exists():
                return pid
        time.sleep(0.1)
    tail = log.read_text()[-3000:] if log.exists() else "(no log)"
    raise RuntimeError(f"no pid in {path} after {START_TIMEOUT:.0f} s; log:\n{tail}")


def record(state: Path, name: str, pid: int) -> None:
    """Each pid is written as soon as its daemon is up, so a failed start still stops what started."""
    path = state / "pids.json"
    pids = json.loads(path.read_text()) if path.exists() else {}
    pids[name] = pid
    path.write_text(json.dumps(pids, indent=1))


def start(state: Path) -> Path:
    """Start munged, slurmctld, slurmd n1 and n2 in ``state``; return the slurm.conf path."""
    started = time.monotonic()
    if state.exists():
        raise RuntimeError(f"{state} exists: stop and remove the previous cluster first")
    state.mkdir(parents=True, mode=0o755)
    munge = state / "munge"
    munge.mkdir(mode=0o755)  # munged: the socket folder must be searchable by all
    shutil.chown(munge, "munge", "munge")
    key, munge_socket = munge / "munge.key", munge / "munge.socket"
    as_munge = ["runuser", "-u", "munge", "--"]
    subprocess.run([*as_munge, "mungekey", "--create", f"--keyfile={key}"], check=True, timeout=60)
    munged = [
        *as_munge,
        "munged",
        f"--socket={munge_socket}",
        f"--key-file={key}",
        f"--log-file={munge}/munged.log",
        f"--pid-file={munge}/munged.pid",
        f"--seed-file={munge}/munged.seed",
    ]
    subprocess.run(munged, check=True, timeout=60)
    record(state, "munged", wait_for_pid_file(munge / "munged.pid", munge / "munged.log"))

    host = socket.gethostname().split(".")[0]
    ports = {name: free_port() for name in ("ctld", *NODES)}
    conf = state / "slurm.conf"
    conf.write_text(slurm_conf(state, host, ports, munge_socket))
    (state / "ctld").mkdir()
    for node in NODES:
        (state / "spool" / node).mkdir(parents=True)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    subprocess.run(["slurmctld", "-c", "-f", str(conf)], check=True, env=env, timeout=60)
    record(state, "slurmctld", wait_for_pid_file(state / "slurmctld.pid", state / "slurmctld.log"))
    for node in NODES:
        subprocess.run(["slurmd", "-f", str(conf), "-N", node], check=True, env=env, timeout=60)
        record(state, f"slurmd-{node}", wait_for_pid_file(state / f"slurmd-{node}.pid", state / f"slurmd-{node}.log"))
    wait_for_idle_nodes(env, state)
    print(f"slurm up in {time.monotonic() - started:.1f} s: {json.loads((state / 'pids.json').read_text())}")
    return conf


def wait_for_idle_nodes(env: dict[str, str], state: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    states = ""
    while time.monotonic() < deadline:
        proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, env=env, timeout=30)
        states = proc.stdout.strip()
        found = dict(line.split() for line in states.splitlines() if len(line.split()) == 2)
        if all(found.get(node) == "idle" for node in NODES):
            return
        time.sleep(0.3)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(state.glob("*.log")))
    raise RuntimeError(f"nodes not idle after {START_TIMEOUT:.0f} s: {states!r}\n{logs}")


def ours(pid: int, name: str, state: Path) -> bool:
    """Whether ``pid`` is still the daemon ``start`` recorded (its name and our state on its command line)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    daemon = name.split("-")[0].encode()
    return bool(argv) and os.path.basename(argv[0]) == daemon and any(str(state).encode() in arg for arg in argv)


def stop(state: Path) -> None:
    """Stop exactly the recorded daemons: SIGTERM, then SIGKILL after 10 s; the slurmds first."""
    path = state / "pids.json"
    if not path.exists():
        print(f"no daemons recorded in {state}")
        return
    pids = json.loads(path.read_text())
    conf = state / "slurm.conf"
    if "slurmctld" in pids and conf.exists():  # end leftover jobs of this cluster (a test that timed out)
        subprocess.run(["scancel", "--quiet", "--user=root"], env={**os.environ, "SLURM_CONF": str(conf)}, timeout=30)
    order = [name for name in (*(f"slurmd-{node}" for node in NODES), "slurmctld", "munged") if name in pids]
    for name in order:
        pid = pids[name]
        if not ours(pid, name, state):
            print(f"{name} (pid {pid}) is not running")
            continue
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while ours(pid, name, state) and time.monotonic() < deadline:
            time.sleep(0.1)
        if ours(pid, name, state):
            os.kill(pid, signal.SIGKILL)
            print(f"stopped {name} (pid {pid}) with SIGKILL")
        else:
            print(f"stopped {name} (pid {pid})")
    path.rename(state / "pids.stopped.json")


def main(argv: list[str]) -> int:
    command, *rest = argv
    if command == "install":
        install()
    elif command == "start":
        try:
            print(f"SLURM_CONF={start(Path(rest[0]))}")
        except BaseException:
            stop(Path(rest[0]))
            raise
    elif command == "stop":
        stop(Path(rest[0]))
    else:
        raise SystemExit(f"unknown command {command!r}: install, start STATE_DIR or stop STATE_DIR")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A one-node SLURM cluster on this machine, bound to 127.0.0.1, for the SLURM tests.

    python3 tools/slurm_cluster.py start DIR   # munged, slurmctld, slurmd; prints SLURM_CONF
    python3 tools/slurm_cluster.py stop DIR    # cancels every job, stops the three daemons

Everything the cluster writes lives in DIR (configuration, state, spool, logs, the munge
key and socket). ``start`` picks free ports, so a contributor's cluster and CI's can run
side by side; ``stop`` ends the daemons by the PIDs in their pid files, never by name.
Needs Debian's ``slurmctld slurmd slurm-client munge`` (22.05 tested) and root: slurmd
starts the jobs' processes. Standard library only: it runs before ``.venv`` exists.

The configuration is what a real cluster needs on a 2-core container without systemd:
the node advertises 8 CPUs (``SlurmdParameters=config_overrides``), or a 4-task job on 2
cores would pend forever instead of running; no cgroups (``proctrack/linuxproc``,
``task/none``); every port on loopback (``NoCtldInAddrAny,NoInAddrAny``); jobs start as
soon as they are submitted (``batch_sched_delay=0``); a requeued job may start again 5 s
after its requeue (``cred_expire=5``; 120 s by default) and the scheduler looks every
second (``sched_interval=1``; 60 s by default): a requeued job restarts in about 6 s
instead of 150; a cancelled job's processes get 2 s between SIGTERM and SIGKILL
(``KillWait``), and a finished job stays visible to ``scontrol show job`` for 10 minutes
(``MinJobAge``).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd", "munged")
CLIENTS = ("sinfo", "squeue", "srun", "sbatch", "salloc", "scancel", "scontrol")
PACKAGES = "slurmctld slurmd slurm-client munge"
READY_TIMEOUT = 30.0
STOP_TIMEOUT = 20.0


class ClusterError(RuntimeError):
    """The cluster cannot start or stop; the message says why and what to do."""


def missing_programs() -> list[str]:
    return [name for name in (*DAEMONS, *CLIENTS) if shutil.which(name) is None]


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 now."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def check_traversable(folder: Path) -> None:
    """munged refuses a socket whose folder's parents others cannot enter ("insecure
    permissions" is not what it says: it says the socket is inaccessible); a
    ``mktemp -d`` folder is mode 700, so a cluster folder must not sit under one."""
    for parent in folder.resolve().parents:
        if parent.exists() and not parent.stat().st_mode & stat.S_IXOTH:
            raise ClusterError(
                f"{parent} is not enterable by other users (mode "
                f"{stat.filemode(parent.stat().st_mode)}), and munged refuses a socket "
                f"below it: put the cluster folder elsewhere (under /tmp, say), or "
                f"chmod o+x {parent}")


def configuration(folder: Path, user: str, ctld_port: int, slurmd_port: int) -> str:
    socket_path = folder / "munge" / "munge.socket"
    return f"""\
# Written by tools/slurm_cluster.py: a one-node cluster on 127.0.0.1.
ClusterName=mgpu
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
AuthInfo=socket={socket_path},cred_expire=5
CredType=cred/munge
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=batch_sched_delay=0,sched_interval=1
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=2
MinJobAge=600
JobRequeue=0
NodeName=localhost NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def run_daemon(command: list[str], folder: Path, log_name: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=30,
                          env={**os.environ, "SLURM_CONF": str(folder / "slurm.conf")})
    if done.returncode != 0:
        log = folder / log_name
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise ClusterError(f"{command[0]} did not start (exit {done.returncode}):\n"
                           f"{done.stdout}{done.stderr}{tail}")


def start(folder: Path) -> Path:
    missing = missing_programs()
    if missing:
        raise ClusterError(f"{', '.join(missing)} not found: install Debian's {PACKAGES} "
                           f"(apt-get install {PACKAGES}), then run this again")
    if os.geteuid() != 0:
        raise ClusterError("slurmd starts every job's processes and must run as root: run "
                           "this as root (sudo), or use a cluster you have")
    if (folder / "slurm.conf").exists():
        raise ClusterError(f"{folder} already holds a cluster: stop it first "
                           f"(python3 tools/slurm_cluster.py stop {folder})")
    check_traversable(folder)  # the folder itself is made enterable here
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o711)
    for sub in ("munge", "state", "spool"):
        (folder / sub).mkdir(exist_ok=True)
    (folder / "munge").chmod(0o711)
    key = folder / "munge" / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o400)

    user = subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip()
    ctld_port, slurmd_port = free_ports(2)
    conf = folder / "slurm.conf"
    conf.write_text(configuration(folder, user, ctld_port, slurmd_port))

    munge = folder / "munge"
    try:
        run_daemon(["munged", f"--socket={munge}/munge.socket", f"--key-file={key}",
                    f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log",
                    f"--seed-file={munge}/munged.seed"], folder, "munge/munged.log")
        run_daemon(["slurmctld", "-f", str(conf)], folder, "slurmctld.log")
        run_daemon(["slurmd", "-f", str(conf), "-N", "localhost"], folder, "slurmd.log")
        wait_until_idle(conf)
    except (ClusterError, subprocess.TimeoutExpired):
        stop(folder)  # leave nothing running after a failed start
        raise
    (folder / "env").write_text(f"export SLURM_CONF={conf}\n")
    return conf


def wait_until_idle(conf: Path) -> None:
    env = {**os.environ, "SLURM_CONF": str(conf)}
    deadline = time.monotonic() + READY_TIMEOUT
    state = ""
    while time.monotonic() < deadline:
        done = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True,
                              text=True, env=env, timeout=10)
        state = (done.stdout + done.stderr).strip()
        if done.returncode == 0 and state == "idle":
            return
        time.sleep(0.2)
    raise ClusterError(f"the node is not idle after {READY_TIMEOUT:.0f} s (sinfo: {state!r});"
                       f" see the logs in {conf.parent}")


def pid_in(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(pid, 0); it is gone for our purpose.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def end(pid: int) -> None:
    """SIGTERM, then SIGKILL after STOP_TIMEOUT; returns when the process is gone."""
    for sig, wait in ((signal.SIGTERM, STOP_TIMEOUT), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not alive(pid):
                return
            time.sleep(0.1)


def cancel_jobs(conf: Path) -> None:
    """Cancel every job and wait until none is left, so that no job step outlives
    slurmd (slurmstepd processes are not slurmd's children)."""
    env = {**os.environ, "SLURM_CONF": str(conf)}
    deadline = time.monotonic() + STOP_TIMEOUT
    while time.monotonic() < deadline:
        done = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True,
                              text=True, env=env, timeout=10)
        jobs = done.stdout.split()
        if done.returncode != 0 or not jobs:
            return
        subprocess.run(["scancel", "--full", *jobs], env=env, capture_output=True,
                       timeout=10)
        time.sleep(0.5)


def stop(folder: Path) -> list[str]:
    """Stop the cluster in ``folder``; returns what it stopped. The folder is kept (its
    logs say what happened); a second stop stops nothing."""
    conf = folder / "slurm.conf"
    if not conf.exists():
        raise ClusterError(f"no cluster in {folder} (no slurm.conf)")
    pids = {"slurmctld": folder / "slurmctld.pid", "slurmd": folder / "slurmd.pid",
            "munged": folder / "munge" / "munged.pid"}
    if pid_in(pids["slurmctld"]) and alive(pid_in(pids["slurmctld"])):
        cancel_jobs(conf)
    stopped = []
    for name in ("slurmd", "slurmctld", "munged"):  # munged last: the others talk to it
        pid = pid_in(pids[name])
        if pid is not None and alive(pid):
            end(pid)
            stopped.append(f"{name} ({pid})")
    conf.rename(folder / "slurm.conf.stopped")
    return stopped


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("start", "stop"))
    parser.add_argument("folder", type=Path, help="where the cluster keeps everything")
    args = parser.parse_args(argv)
    folder = args.folder.absolute()
    try:
        if args.action == "start":
            started = time.monotonic()
            conf = start(folder)
            print(f"SLURM cluster up in {time.monotonic() - started:.1f} s: "
                  f"export SLURM_CONF={conf}", file=sys.stderr)
            print(conf)
        else:
            stopped = stop(folder)
            print(f"stopped {', '.join(stopped) or 'nothing (no daemon was running)'}",
                  file=sys.stderr)
    except ClusterError as error:
        print(f"slurm_cluster: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Running jobs on a real SLURM cluster from a test: srun, salloc and sbatch, each bounded.

The tests run where ``SLURM_CONF`` names a cluster that answers (``make slurm-test``
starts a one-node one with ``tools/slurm_cluster.py`` and sets it; so does ``.ci/run``).
Elsewhere they skip, saying so, unless ``MGPU_REQUIRE_SLURM=1`` (set by ``.ci/run``),
which turns a missing cluster into a failure. They do not look for a site's cluster by
themselves: set ``SLURM_CONF`` to test on one.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
# A job's states once it will run no more (a requeued job passes through REQUEUED,
# then PENDING, and runs again).
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
         "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def why_no_cluster() -> str | None:
    if not os.environ.get("SLURM_CONF"):
        return "SLURM_CONF is not set"
    try:
        done = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                              timeout=15)
    except FileNotFoundError:
        return "sinfo is not installed"
    except subprocess.TimeoutExpired:
        return f"sinfo did not answer in 15 s (SLURM_CONF={os.environ['SLURM_CONF']})"
    if done.returncode != 0:
        return f"sinfo failed: {done.stderr.strip()}"
    return None


def require_cluster() -> None:
    problem = why_no_cluster()
    if problem is None:
        return
    if os.environ.get("MGPU_REQUIRE_SLURM") == "1":
        pytest.fail(f"MGPU_REQUIRE_SLURM=1 but no SLURM cluster: {problem}")
    pytest.skip(f"no SLURM cluster ({problem}); `make slurm-test` starts one (as root, "
                "with Debian's slurmctld slurmd slurm-client munge) and runs these tests")


_GIVEN_PORTS: set[int] = set()


def free_port() -> int:
    """A port free on 127.0.0.1 now and never given before in this session: jobs that
    run at the same time rendezvous on ports of their own."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _GIVEN_PORTS:
            _GIVEN_PORTS.add(port)
            return port


def job_env(**extra: str) -> dict[str, str]:
    """The environment jobs get (sbatch, srun and salloc pass theirs on): none of this
    process's SLURM or torchrun variables but SLURM_CONF (the jobs would show them);
    this Python's folder first on PATH, so that ``python`` in a job is the one running
    the tests; one intra-op thread per process, as ``mh.launch`` gives its ranks, so
    that runs compare bitwise; a fresh rendezvous port (job ids restart at 1 with every
    new cluster, so the default port from the job id can collide between clusters)."""
    env = {key: value for key, value in os.environ.items() if key == "SLURM_CONF" or not
           key.startswith(("SLURM", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    env["PATH"] = f"{Path(PYTHON).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    env.update(extra)
    return env


def run(command: list[str], timeout: float, env: dict | None = None,
        cwd: Path = ROOT) -> str:
    """Run srun or salloc, bounded by ``timeout``; its output, or a failure showing it."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env=env or job_env(), cwd=cwd)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{' '.join(command[:3])}... still running after {timeout:.0f} s:\n"
                    f"{_text(error.stdout)[-3000:]}{_text(error.stderr)[-3000:]}")
    assert done.returncode == 0, (f"{' '.join(command)} exited {done.returncode}:\n"
                                  f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.stdout + done.stderr


class Started:
    """srun (or salloc) running in the background, its output going to ``log``, bounded
    by ``timeout`` from its start; ended, if still running, when the ``with`` block ends
    (a failure in the block leaves no process behind)."""

    def __init__(self, command: list[str], log: Path, timeout: float,
                 env: dict | None = None, cwd: Path = ROOT):
        self.command, self.log, self.timeout = command, log, timeout
        self.deadline = time.monotonic() + timeout
        with open(log, "w") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                            env=env or job_env(), cwd=cwd)

    def __enter__(self) -> Started:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def output(self) -> str:
        """Wait for the end (until the deadline); its output, or a failure showing it."""
        try:
            self.process.wait(max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"{' '.join(self.command[:3])}... still running after "
                        f"{self.timeout:.0f} s:\n{self.log.read_text(errors='replace')[-3000:]}")
        text = self.log.read_text(errors="replace")
        assert self.process.returncode == 0, (f"{' '.join(self.command)} exited "
                                              f"{self.process.returncode}:\n{text[-3000:]}")
        return text

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()  # srun passes it on to the step's tasks
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def submit(script: Path, log: Path, *options: str, args: tuple[str, ...] = (),
           env: dict | None = None) -> str:
    """``sbatch [options] script [args]``, its output to ``log``; the job id."""
    command = ["sbatch", "--parsable", f"--output={log}", *options, str(script), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30,
                          env=env or job_env(), cwd=ROOT)
    assert done.returncode == 0, f"{' '.join(command)}: {done.stderr}"
    return done.stdout.strip().split(";")[0]


def job_fields(job_id: str) -> dict[str, str]:
    """``scontrol show job``'s fields (JobState, Restarts, ExitCode...)."""
    done = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                          text=True, timeout=15)
    assert done.returncode == 0, f"scontrol show job {job_id}: {done.stderr}"
    return dict(field.split("=", 1) for field in done.stdout.split() if "=" in field)


def cancel(job_id: str) -> None:
    subprocess.run(["scancel", job_id], capture_output=True, timeout=15)


def signal(job_id: str, name: str) -> None:
    """Send the signal to every task of the job's steps, not to the batch shell (as
    ``--signal=USR1@120`` does at its time)."""
    done = subprocess.run(["scancel", f"--signal={name}", job_id], capture_output=True,
                          text=True, timeout=15)
    assert done.returncode == 0, f"scancel --signal={name} {job_id}: {done.stderr}"


def wait_until(job_id: str, timeout: float, done, log: Path | None = None) -> dict:
    """Poll the job every 0.2 s until ``done(fields)``; cancel it and fail after
    ``timeout`` s, showing its state and the end of its log."""
    deadline = time.monotonic() + timeout
    fields = {}
    while time.monotonic() < deadline:
        fields = job_fields(job_id)
        if done(fields):
            return fields
        time.sleep(0.2)
    cancel(job_id)
    tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
    pytest.fail(f"job {job_id} not done after {timeout:.0f} s (state "
                f"{fields.get('JobState')}, reason {fields.get('Reason')}):\n{tail}")


def wait_for_end(job_id: str, timeout: float, log: Path | None = None) -> dict:
    return wait_until(job_id, timeout, lambda fields: fields["JobState"] in ENDED, log)

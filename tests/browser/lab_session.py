"""A JupyterLab server and a headless Chromium for the browser test, always shut down.

The server runs on a free 127.0.0.1 port with a random token, over a *copy* of the
chapters (a browser run saves notebooks; the repository's stored outputs must not
change), with its own settings: notebooks render every cell (no virtual scrolling, so
every output is in the page), no autosave, no news or update checks.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_ENV = ROOT / "tests" / "notebook.env"
CHROMIUM_NAMES = ("chromium", "chromium-browser")
# Flags for a root user in a container with a closed network (see Chromium's docs).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]
# make lab's defaults (no news pop-up, no update checks), plus what the test needs.
OVERRIDES = json.loads((ROOT / "tools" / "jupyterlab_overrides.json").read_text())
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        OVERRIDES["@jupyterlab/apputils-extension:notification"],
}


def find_chromium() -> str | None:
    """``$MGPU_CHROMIUM``, else Debian's ``chromium`` on the PATH."""
    explicit = os.environ.get("MGPU_CHROMIUM")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


def notebook_env() -> dict[str, str]:
    """tests/notebook.env, the settings every kernel of the workbook runs under."""
    settings = {}
    for line in NOTEBOOK_ENV.read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            settings[key] = value
    return settings


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def prepare_workdir(workdir: Path, chapters: list[str]) -> Path:
    """A copy of the chosen chapters beside links to what they read (data, results, code)."""
    (workdir / "notebooks").mkdir(parents=True)
    for name in chapters:
        shutil.copy2(ROOT / "notebooks" / name, workdir / "notebooks" / name)
    for shared in ("data", "benchmarks", "mgpu_helpers"):
        (workdir / shared).symlink_to(ROOT / shared)
    settings = workdir / ".lab-settings"
    for name, values in LAB_SETTINGS.items():
        path = settings / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    return workdir


class LabServer:
    """``jupyter lab`` over ``workdir``; use as a context manager."""

    def __init__(self, workdir: Path, log: Path):
        self.workdir = workdir
        self.log_path = log
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.base = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> LabServer:
        env = {**os.environ, **notebook_env(),
               "JUPYTER_CONFIG_DIR": str(self.workdir / ".jupyter"),
               "JUPYTER_RUNTIME_DIR": str(self.workdir / ".runtime")}
        command = [sys.executable, "-m", "jupyterlab", "--no-browser",
                   "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}",
                   "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
                   f"--ServerApp.root_dir={self.workdir}",
                   f"--LabApp.user_settings_dir={self.workdir / '.lab-settings'}",
                   f"--LabApp.workspaces_dir={self.workdir / '.workspaces'}"]
        if os.getuid() == 0:
            command.append("--allow-root")
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(command, cwd=self.workdir, env=env, stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        try:
            self._wait_until_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_until_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self.process.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                self.api("GET", "/api/status")
                return
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.5)
        raise RuntimeError(f"jupyter lab did not answer within {timeout:.0f} s:\n"
                           f"{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def api(self, method: str, path: str):
        request = urllib.request.Request(self.base + path, method=method)
        request.add_header("Authorization", f"token {self.token}")
        with urllib.request.urlopen(request, timeout=30) as response:
            body = response.read()
        return json.loads(body) if body else None

    def url(self, path: str) -> str:
        return f"{self.base}{path}?token={self.token}"

    def saved_notebook(self, relative: str) -> dict:
        """The notebook as the server has it on disk (after the browser saved it)."""
        return self.api("GET", f"/api/contents/{relative}?content=1")["content"]

    def modified(self, relative: str) -> str:
        """The file's modification time as the server reports it (no content read)."""
        return self.api("GET", f"/api/contents/{relative}?content=0")["last_modified"]

    def kernel_pids(self) -> list[int]:
        """Kernels this server started: their connection files are in its runtime dir."""
        runtime = str(self.workdir / ".runtime").encode()
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    command = Path(f"/proc/{entry}/cmdline").read_bytes()
                except OSError:
                    continue
                if b"ipykernel_launcher" in command and runtime in command:
                    pids.append(int(entry))
        return pids

    def __exit__(self, *exc) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        kernels = self.kernel_pids()
        try:  # shut kernels down through the server first, as JupyterLab would
            for kernel in self.api("GET", "/api/kernels"):
                self.api("DELETE", f"/api/kernels/{kernel['id']}")
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        for pid in kernels:  # anything the server failed to stop
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@contextmanager
def chromium_page(executable: str, viewport=(1400, 900)):
    """A page in headless Chromium, driven by Playwright; the browser always closes."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True,
                                             args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]})
            yield page
        finally:
            browser.close()

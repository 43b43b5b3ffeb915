"""`make lab` serves JupyterLab on loopback with a token, and its kernels launch ranks.

Starts the real `make lab` on a free port, reads the URL it prints, checks that it opens
the landing page it wrote (chapter map and this machine's report), that the server
refuses requests without the token and ships the workbook's JupyterLab defaults (no news
pop-up), runs cells in a kernel started through the server (as the browser would), one
of which launches 2 ranks, and shuts everything down. The chapters themselves run under
nbval, in the browser test and in `make gpu-check`.
"""

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest
from tornado.websocket import websocket_connect

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CHAPTER = "notebooks/00_environment.ipynb"
LANDING = "notebooks/start_here.ipynb"
CELLS = [
    "import mgpu_helpers as mh\nprint(mh.describe().plan.summary)",
    "print(mh.launch(mh.rank, nprocs=2, backend='gloo', return_all=True))",
    "raise ValueError('shown on purpose')",
]
URL_PATTERN = re.compile(r"(http://127\.0\.0\.1:(\d+))/lab/tree/(\S+)\?token=(\w+)")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_url(server: subprocess.Popen, log: Path, timeout: float = 120.0) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = URL_PATTERN.search(log.read_text())
        if match:
            return match
        if server.poll() is not None:
            pytest.fail(f"make lab exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    pytest.fail(f"make lab printed no URL within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def wait_until_answering(base: str, timeout: float = 60.0) -> None:
    """Jupyter prints its URL a moment before it accepts connections."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"{base}/api/status", timeout=10)
            return
        except urllib.error.HTTPError:
            return  # it answered (403 without the token)
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def http(url: str, token: str | None = None, method: str = "GET", body: dict | None = None):
    request = urllib.request.Request(url, method=method,
                                     data=None if body is None else json.dumps(body).encode())
    if token:
        request.add_header("Authorization", f"token {token}")
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status, json.loads(response.read() or b"null")


async def run_cells(ws_url: str, sources: list[str]) -> list[tuple[tuple[str, str] | None, str]]:
    """Execute each source in order; per cell, its (ename, evalue) or None, and its stdout."""
    connection = await websocket_connect(ws_url)
    session = uuid.uuid4().hex
    results = []
    try:
        for code in sources:
            msg_id = uuid.uuid4().hex
            await connection.write_message(json.dumps({
                "header": {"msg_id": msg_id, "session": session, "username": "test",
                           "msg_type": "execute_request", "version": "5.3"},
                "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
                "content": {"code": code, "silent": False, "store_history": True,
                            "user_expressions": {}, "allow_stdin": False,
                            "stop_on_error": False},
            }))
            error, stdout = None, ""
            while True:
                raw = await asyncio.wait_for(connection.read_message(), timeout=300)
                assert raw is not None, "the kernel websocket closed"
                message = json.loads(raw)
                if message.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind = message["header"]["msg_type"]
                if kind == "stream" and message["content"]["name"] == "stdout":
                    stdout += message["content"]["text"]
                if kind == "error":
                    error = (message["content"]["ename"], message["content"]["evalue"])
                if kind == "status" and message["content"]["execution_state"] == "idle":
                    break
            results.append((error, stdout))
    finally:
        connection.close()
    return results


def test_make_lab_serves_chapter_00_on_loopback_with_token(tmp_path):
    log = tmp_path / "lab.log"
    with log.open("w") as out:
        server = subprocess.Popen(["make", "--no-print-directory", "lab",
                                   f"LAB_PORT={free_port()}"],
                                  cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
    kernel_pid = None
    try:
        match = wait_for_url(server, log)
        base, port, opened, token = match.groups()
        assert opened == LANDING, "make lab should open the landing page"
        wait_until_answering(base)
        status, landing = http(f"{base}/api/contents/{LANDING}?content=1", token)
        text = json.dumps(landing["content"])
        assert "00_environment.ipynb" in text and "09_debugging_distributed.ipynb" in text
        assert "Workbook plan" in text, "the landing page shows this machine's report"

        with pytest.raises(urllib.error.HTTPError) as refused:
            http(f"{base}/api/sessions")
        assert refused.value.code == 403, "the server must require its token"

        status, session = http(f"{base}/api/sessions", token, "POST", {
            "path": CHAPTER, "type": "notebook", "name": Path(CHAPTER).name,
            "kernel": {"name": "python3"}})
        assert status == 201
        ws_url = (f"ws://127.0.0.1:{port}/api/kernels/{session['kernel']['id']}/channels"
                  f"?token={token}")

        results = asyncio.run(run_cells(ws_url, [*CELLS, "import os; print(os.getpid())"]))
        pid_error, pid_text = results.pop()
        assert pid_error is None
        kernel_pid = int(pid_text)
        (plan_error, plan), (launch_error, ranks), (raised, _) = results
        assert plan_error is None and ("gloo" in plan or "GPU" in plan), plan
        assert launch_error is None and ranks.strip() == "[0, 1]", (launch_error, ranks)
        assert raised == ("ValueError", "shown on purpose")

        # make lab's JupyterLab defaults: no "get notified about Jupyter news?" pop-up
        status, notification = http(
            f"{base}/lab/api/settings/@jupyterlab/apputils-extension:notification", token)
        defaults = notification["schema"]["properties"]  # JupyterLab's own: "none", true
        assert defaults["fetchNews"]["default"] == "false"
        assert defaults["checkForUpdates"]["default"] is False
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    # Stopping the server must not leave the chapter's kernel behind.
    deadline = time.monotonic() + 30
    while kernel_pid and psutil.pid_exists(kernel_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not (kernel_pid and psutil.pid_exists(kernel_pid)), "kernel left running"

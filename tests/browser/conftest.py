"""JupyterLab on loopback and headless Chromium, for the real-browser test.

`make browser-test` runs tests/browser with KVLIB_BROWSER_TEST=1; plain `make test` collects
the module but skips it (it needs Chromium and Playwright, and a minute). When the variable
is set, a missing Chromium or Playwright is a failure, not a skip: CI must not pass quietly.

JupyterLab serves a copy of notebooks/ (running cells marks a notebook changed, and nothing
here may write to the checkout) with its own settings, data and runtime folders: autosave
off, every cell attached to the page (no windowing, so every widget is in the DOM), no news
fetched from the network. kvlib comes from the environment running pytest.
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
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENABLED = os.environ.get("KVLIB_BROWSER_TEST") == "1"
SKIP_REASON = ("the browser test runs with `make browser-test` (it sets KVLIB_BROWSER_TEST=1 "
               "and needs Chromium and Playwright)")
CHROMIUM = os.environ.get("KVLIB_CHROMIUM", "/usr/bin/chromium")
# The flags the field notes give for this machine: no sandbox as root, and nothing that
# reaches for Google's servers (refused here, slowly, many at a time).
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run",
                  "--disable-quic", "--disable-dev-shm-usage"]
SCREENSHOTS = ROOT / "artifacts" / "screenshots"
SERVER_START_SECONDS = 90

LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings":
        {"windowingMode": "none", "scrollPastEnd": False},
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


class LabServer:
    """A JupyterLab process on 127.0.0.1 serving `root`, stopped (with its kernels) by stop()."""

    def __init__(self, home: Path):
        self.home = home
        self.root = home / "root"
        shutil.copytree(ROOT / "notebooks", self.root / "notebooks",
                        ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
        settings = home / "settings"
        for relative, values in LAB_SETTINGS.items():
            path = settings / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values), encoding="utf-8")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items()
               if k not in ("JUPYTER_PATH", "PYTHONPATH", "JUPYTER_TOKEN")}
        env.update(JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_DATA_DIR=str(home / "data"),
                   JUPYTER_RUNTIME_DIR=str(home / "runtime"), IPYTHONDIR=str(home / "ipython"))
        for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env.setdefault(variable, "1")    # as binder/start and `make lab` give the kernels
        self.log_path = home / "server.log"
        command = [
            sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
            "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0", "--IdentityProvider.token=",
            "--LabApp.expose_app_in_browser=True", f"--ServerApp.root_dir={self.root}",
            f"--LabApp.user_settings_dir={settings}",
            f"--LabApp.workspaces_dir={home / 'workspaces'}",
        ]
        with open(self.log_path, "w", encoding="utf-8") as log:
            # its own process group, so that stop() reaches anything it started
            self.process = subprocess.Popen(command, cwd=self.root, env=env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def wait_until_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {self.process.returncode}:\n"
                                   + self.log_tail())
            if answers(f"{self.url}/api/status") and answers(f"{self.url}/lab"):
                return
            time.sleep(0.5)
        raise RuntimeError(f"JupyterLab did not answer within {SERVER_START_SECONDS} s:\n"
                           + self.log_tail())

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(encoding="utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            # SIGTERM: the server shuts its kernels down, then exits
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


@pytest.fixture(scope="session")
def lab_server(tmp_path_factory):
    server = LabServer(tmp_path_factory.mktemp("jupyterlab"))
    try:
        server.wait_until_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("Playwright is not installed: `make browser-test` installs "
                    "requirements-browser.txt into .venv")
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"no Chromium at {CHROMIUM}: `apt-get install -y chromium` (Debian), or "
                    "point KVLIB_CHROMIUM at a Chromium binary")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True,
                                              args=CHROMIUM_FLAGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="session")
def screenshots() -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return SCREENSHOTS

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
MODEL_NAME = "tiny-qwen3"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(process: subprocess.Popen, base_url: str, output, what: str, timeout: float) -> None:
    """Until `base_url`/health answers 200; raises with the process's `output()` if it exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited: {output()}")
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not become healthy")


class ServerProcess:
    def __init__(
        self,
        model: Path,
        *extra: str,
        api_key: str | None = API_KEY,
        env: dict[str, str] | None = None,
        name_flag: bool = True,
        wait: bool = True,
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable,
            "-m",
            "kestrel",
            "serve",
            str(model),
            "--port",
            str(self.port),
            *(["--served-model-name", MODEL_NAME] if name_flag else []),
            *extra,
        ]
        if api_key:
            command += ["--api-key", api_key]
        self.terminated = False
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Output goes to a file, not a pipe nobody drains: a full pipe would block the server's logging.
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kestrel-server-", suffix=".log")  # noqa: SIM115
        self.process = subprocess.Popen(
            command, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, text=True, env=dict(os.environ, **(env or {}))
        )
        if wait:  # otherwise the caller starts others meanwhile, then calls `wait_healthy`
            self.wait_healthy()

    def wait_healthy(self, timeout: float = 120) -> None:
        wait_healthy(self.process, self.base_url, self.output, "server", timeout)

    def output(self) -> str:
        """Everything the server printed so far."""
        return Path(self.log.name).read_text()

    def core_pids(self) -> list[int]:
        """The server's engine-core child (multiprocessing's resource tracker is left out)."""
        children = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                command = (stat.parent / "cmdline").read_bytes()
            except OSError:
                continue
            if int(fields[1]) == self.process.pid and b"spawn_main" in command:
                children.append(int(stat.parent.name))
        return children

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.base_url}/metrics").text
        for line in text.splitlines():
            if line.startswith(f"kestrel:{name}{{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def terminate(self) -> None:
        """SIGTERM, as an orchestrator would; `stop` then only waits."""
        self.terminated = True
        self.process.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.process.poll() is None:
            if not self.terminated:
                self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        for pid in self.core_pids():
            os.kill(pid, signal.SIGKILL)


class RouterProcess:
    def __init__(self, prefill: list[str], decode: list[str], timeout: float = 60) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "kestrel", "router", "--host", "127.0.0.1", "--port", str(self.port)]
        command += ["--prefill", *prefill, "--decode", *decode, "--timeout", str(timeout)]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kestrel-router-", suffix=".log")  # noqa: SIM115
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        wait_healthy(self.process, self.base_url, lambda: Path(self.log.name).read_text(), "router", 60)

    def client(self, **options):
        import openai  # here: the GPU suite's machine talks to the router with httpx alone

        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=API_KEY, **options)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def stop_together(router: RouterProcess, *servers: ServerProcess) -> None:
    """Signal every process first, then wait for each: their shutdowns overlap."""
    router.process.terminate()
    for server in servers:
        if server.process.poll() is None and not server.terminated:
            server.process.send_signal(signal.SIGTERM)
            server.terminated = True
    router.stop()
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def server_model(checkpoint_dir) -> Path:
    return checkpoint_dir("qwen3")


# The shared server's engine: prompts over 256 tokens are prefilled in chunks, pages are small.
SERVER_ARGS = ("--max-num-batched-tokens", "256", "--page-size", "8")


@pytest.fixture(scope="session")
def server(server_model):
    process = ServerProcess(server_model, *SERVER_ARGS)
    yield process
    process.stop()


SMOLLM2 = "smollm2"


@pytest.fixture(scope="session")
def smollm2_server():
    """The demo model served with tool calling on (hermes format), shared by the modules that
    need real text: structured outputs, tools, the Responses and Messages APIs."""
    from kestrel.demo import smollm2_gguf

    try:
        model = smollm2_gguf()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    process = ServerProcess(
        model,
        "--served-model-name",
        SMOLLM2,
        "--max-num-seqs",
        "64",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        api_key=None,
        name_flag=False,
    )
    yield process
    process.stop()

"""--record takes regular files only, and SIGTERM ends the real agent process whatever its threads are stuck in."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import orjson
import pytest

from gpufleet.agent.cli import SHUTDOWN_SECONDS, main
from tests.slowloris import probe

ROOT = Path(__file__).resolve().parents[2]

# The agent as its console script runs it, with one NVML call made to hang in the driver from the fourth
# call on (the first cycles sample normally, so the agent is fully up when it hangs).
HANGING_NVML = """
import sys, threading
from gpufleet.agent.sim.nvml import SimNvml
from gpufleet.agent.cli import main

real = SimNvml.nvmlDeviceGetComputeRunningProcesses
calls = [0]

def hanging(self, handle):
    calls[0] += 1
    if calls[0] > 3:
        sys.stderr.write('{"msg": "test: nvml call hangs"}\\n')
        threading.Event().wait()
    return real(self, handle)

SimNvml.nvmlDeviceGetComputeRunningProcesses = hanging
sys.exit(main(sys.argv[1:]))
"""


def test_record_refuses_a_fifo_in_one_line(tmp_path, capsys):
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    assert main(["--simulate", "hgx-h100", "--record", str(fifo)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--record: {fifo} is not a regular file" in err


class _Agent:
    """A running agent process and the lines of its log, as they come."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            with contextlib.suppress(ValueError):
                self.lines.put(orjson.loads(line))

    def wait_for_log(self, msg: str, timeout: float = 30.0) -> dict:
        while True:
            record = self.lines.get(timeout=timeout)  # queue.Empty fails the test
            if record.get("msg") == msg:
                return record


@contextlib.contextmanager
def _agent(*args: str) -> Iterator[_Agent]:
    cmd = [sys.executable, *args, "--web.listen-address", "127.0.0.1:0", "--log.format", "json"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        yield _Agent(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _stuck_clients(port: int) -> list[socket.socket]:
    """A client trickling its request and one that asked for the whole ring and reads none of it."""
    trickling = socket.create_connection(("127.0.0.1", port), timeout=10)
    trickling.sendall(b"GET /metrics HTTP/1.1\r\nHost: a\r\n")
    reading_nothing = socket.socket()
    reading_nothing.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    reading_nothing.connect(("127.0.0.1", port))
    reading_nothing.sendall(b"GET /snapshots HTTP/1.1\r\nHost: a\r\n\r\n" * 50)
    return [trickling, reading_nothing]


def _ends_with_0_on_sigterm(agent: _Agent) -> None:
    agent.proc.send_signal(signal.SIGTERM)
    # The bound is the shutdown budget plus the interpreter's own start and exit: a hang would run to it.
    assert agent.proc.wait(timeout=SHUTDOWN_SECONDS + 10) == 0
    assert agent.wait_for_log("agent stopped")


def test_sigterm_ends_the_agent_with_an_nvml_call_hung_and_clients_stuck():
    with _agent("-c", HANGING_NVML, "--simulate", "hgx-h100", "--sample.interval", "0.2") as agent:
        port = agent.wait_for_log("agent started")["port"]
        clients = _stuck_clients(port)
        try:
            agent.wait_for_log("test: nvml call hangs")
            _ends_with_0_on_sigterm(agent)
        finally:
            for sock in clients:
                sock.close()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_sigterm_ends_the_agent_with_its_record_write_blocked_on_a_fifo(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.touch()
    args = ("-m", "gpufleet.agent.cli", "--simulate", "hgx-h100", "--sample.interval", "0.2", "--record", str(trace))
    with _agent(*args) as agent:
        port = agent.wait_for_log("agent started")["port"]
        # A snapshot is recorded before it is served: once one is served, the file is open.
        assert any(probe(port, "/snapshot") == 200 for _ in range(10_000))
        # The file swapped for a FIFO with no reader: the next write's open blocks, holding the recorder.
        os.mkfifo(tmp_path / "fifo")
        os.replace(tmp_path / "fifo", trace)
        agent.wait_for_log("record file moved away, starting a new one")
        _ends_with_0_on_sigterm(agent)

"""A single-member etcd (Debian's ``etcd-server``) on loopback, for tests and benchmarks.

Production runs point ``--rdzv-endpoint`` at the cluster they have; this starts one
member on free ports in a data directory of its own, waits until it answers, and stops
it (SIGTERM, then SIGKILL) on exit. The Makefile installs the binary when it is missing.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Optional

from pitstop.errors import PitstopError


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def etcd_binary() -> Optional[str]:
    return shutil.which("etcd") or (("/usr/bin/etcd") if Path("/usr/bin/etcd").exists() else None)


class EtcdServer:
    """``with EtcdServer(dir) as e: e.endpoint`` -> ``"127.0.0.1:PORT"``."""

    def __init__(self, data_dir: Path, host: str = "127.0.0.1", start_timeout_s: float = 20.0) -> None:
        self.data_dir = Path(data_dir)
        self.host = host
        self.start_timeout_s = start_timeout_s
        self.proc: Optional[subprocess.Popen] = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> "EtcdServer":
        binary = etcd_binary()
        if binary is None:
            raise PitstopError("etcd is not installed: `make etcd` (a prerequisite of `make test`) installs Debian's etcd-server "
                               "(apt-get install etcd-server)")
        for attempt in range(3):  # a free port can be taken between the probe and etcd's bind
            self.port, peer = _free_port(self.host), _free_port(self.host)
            self.data_dir.mkdir(parents=True, exist_ok=True)
            log_path = self.data_dir / f"etcd-{attempt}.log"
            client, peer_url = f"http://{self.host}:{self.port}", f"http://{self.host}:{peer}"
            with open(log_path, "wb") as out:
                self.proc = subprocess.Popen(
                    [binary, "--name", "pitstop", "--data-dir", str(self.data_dir / f"data-{attempt}"),
                     "--listen-client-urls", client, "--advertise-client-urls", client,
                     "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                     "--initial-cluster", f"pitstop={peer_url}", "--log-level", "warn"],
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            deadline = time.monotonic() + self.start_timeout_s
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    with urllib.request.urlopen(f"{client}/version", timeout=1) as r:
                        json.loads(r.read())
                    return self
                except OSError:
                    time.sleep(0.05)
            text = log_path.read_text(errors="replace")
            self.stop()
            if "address already in use" not in text:
                raise PitstopError(f"etcd did not start on {self.endpoint} within {self.start_timeout_s:.0f}s: "
                                   f"{text[-800:]}")
        raise PitstopError(f"etcd could not bind a free port on {self.host} in 3 tries")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> "EtcdServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

"""The control-plane store: a real ``TCPStore``, hosted by the controller (launcher).

Workers are clients. Under a plain ``torchrun`` (no pitstop controller) rank 0
hosts it, exactly as ``init_process_group("env://")`` would.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Tuple

import torch.distributed as dist

from pitstop.errors import PitstopError

ENV_STORE = "PITSTOP_STORE"


def host_store(host: str = "127.0.0.1", port: int = 0, timeout: timedelta = timedelta(minutes=5)) -> dist.TCPStore:
    """Host the control store on ``host`` only (port 0: the kernel picks a free port; read ``.port``).

    ``TCPStore`` on its own listens on every interface (``*:PORT``) whatever host it is
    given. So pitstop binds the listening socket itself, to that one address, and hands
    it over (``master_listen_fd``): the default ``127.0.0.1`` is reachable from this
    machine only, and ``--rdzv-endpoint HOST:PORT`` names the one interface to open."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise PitstopError(f"cannot listen on {host}:{port} for the control store: {exc.strerror or exc}") from None
    bound = sock.getsockname()[1]
    # the store owns the descriptor from here on: Python must not close it when ``sock`` goes
    return dist.TCPStore(host, bound, is_master=True, wait_for_workers=False, timeout=timeout,
                         master_listen_fd=sock.detach())


def parse_endpoint(text: str) -> Tuple[str, int]:
    """``HOST:PORT`` with a port in 0..65535 (0: pick a free one), or an error naming the text."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise PitstopError(f"store endpoint {text!r} must look like HOST:PORT")
    if not 0 <= int(port) <= 65535:
        raise PitstopError(f"store endpoint {text!r}: port {int(port)} is out of range, expected 0..65535")
    return host.strip("[]"), int(port)


def connect_from_env(timeout: timedelta = timedelta(minutes=5)) -> dist.TCPStore:
    """Connect to the control store named by the environment.

    ``PITSTOP_STORE=HOST:PORT`` (set by ``pitstop`` launchers) wins; otherwise
    ``MASTER_ADDR``/``MASTER_PORT`` as torchrun sets them, with rank 0 hosting
    unless ``TORCHELASTIC_USE_AGENT_STORE`` says the agent does.
    """
    if os.environ.get(ENV_STORE):
        host, port = parse_endpoint(os.environ[ENV_STORE])
        return dist.TCPStore(host, port, is_master=False, timeout=timeout)
    try:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        rank = int(os.environ["RANK"])
    except KeyError as exc:
        raise PitstopError(
            f"no control store: set {ENV_STORE}=HOST:PORT or torchrun's MASTER_ADDR, "
            f"MASTER_PORT and RANK (missing {exc.args[0]})"
        ) from None
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return dist.TCPStore(host, port, is_master=(rank == 0 and not agent), wait_for_workers=False, timeout=timeout)

"""Shared fixtures: bounded waits on real processes, with every rank's log tail on failure."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pitstop.launch.local import LocalJob

ROOT = Path(__file__).resolve().parents[1]


class JobFailed(AssertionError):
    pass


def tails(job: LocalJob) -> str:
    return "\n".join(LocalJob.log_tail(ctx) for ctx in job.contexts)


def check_alive(job: LocalJob) -> None:
    for ctx in job.contexts:
        res = ctx.wait(timeout=0, period=0)
        if res is not None and res.is_failed():
            raise JobFailed(f"{ctx.name} failed: {res.failures}\n{tails(job)}")


def wait_counter(job: LocalJob, key: str, n: int, timeout: float = 120.0) -> None:
    """Wait until store counter ``key`` reaches ``n``; fail early if a process died."""
    deadline = time.monotonic() + timeout
    while job.store.add(key, 0) < n:
        check_alive(job)
        if time.monotonic() > deadline:
            raise JobFailed(f"{key} reached {job.store.add(key, 0)} of {n} in {timeout}s\n{tails(job)}")
        time.sleep(0.05)


def wait_done(job: LocalJob, ctx, timeout: float = 120.0):
    """Wait for every process of ``ctx`` to exit 0; on failure raise with log tails."""
    res = ctx.wait(timeout=timeout, period=0.1)
    if res is None:
        raise JobFailed(f"{ctx.name} did not finish within {timeout}s\n{tails(job)}")
    if res.is_failed():
        raise JobFailed(f"{ctx.name} failed: {res.failures}\n{tails(job)}")
    return res


class DictStore:
    """The four calls a control channel makes of a store, on a dict: for pure tests of code that
    reads and writes sealed messages (the real TCPStore is tested where its behaviour matters)."""

    def __init__(self):
        self.d = {}

    def set(self, k, v):
        self.d[k] = v.encode() if isinstance(v, str) else bytes(v)

    def get(self, k):
        return self.d[k]

    def check(self, ks):
        return all(k in self.d for k in ks)


@pytest.fixture
def dict_store():
    return DictStore()


@pytest.fixture
def job(tmp_path):
    j = LocalJob(tmp_path / "run")
    yield j
    j.close()


def run_checksums(run_dir, argv, world: int, timeout: float = 400.0) -> dict:
    """Each rank's ``{"rank": ...}`` line of a plain world running ``argv`` (see ``run_plain``)."""
    from pitstop.launch.local import run_plain

    return run_plain(run_dir, argv, world, timeout)


@pytest.fixture(scope="session")
def etcd_endpoint(tmp_path_factory):
    """One real etcd (Debian's etcd-server, installed by the Makefile) on free loopback
    ports for the whole session; each test uses keys under its own job prefix."""
    from pitstop.launch.etcd_server import EtcdServer

    server = EtcdServer(tmp_path_factory.mktemp("etcd")).start()
    yield server.endpoint
    server.stop()

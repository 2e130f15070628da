"""Tier 2 tests of pitstop.pg (world group, composite groups) plus the c10d API pins."""

import inspect
import json

import pytest
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from conftest import ROOT, wait_done

WORKER = str(ROOT / "tests" / "workers" / "pg_worker.py")


def test_private_c10d_api_is_what_pitstop_calls():
    """pitstop.pg calls these private c10d functions; fail loudly if upstream changes them."""
    params = list(inspect.signature(c10d._new_process_group_helper).parameters)
    assert params[:6] == ["group_size", "group_rank", "global_ranks_in_group", "backend", "store", "group_name"]
    assert {"timeout", "group_desc"} <= set(params)
    reg = inspect.signature(c10d._register_pg_in_world).parameters
    assert {"pg", "backend_name", "store", "group_name", "backend_config", "rank_mapping"} <= set(reg)
    assert hasattr(c10d._world, "pg_group_ranks") and isinstance(c10d._world.pg_group_ranks, dict)
    assert "extended_api" in inspect.signature(dist.Backend.register_backend).parameters
    # pitstop.pg.create.rename moves a group to its stable name through these
    assert callable(c10d._register_process_group) and callable(c10d._unregister_process_group)
    assert all(isinstance(getattr(c10d._world, t), dict) for t in ("pg_names", "pg_to_tag", "tags_to_pg"))


def test_registration_without_register_pg_in_world_fills_the_same_tables():
    """``register_python_group`` falls back to :func:`pitstop.pg._register_pg_in_world_compat`
    on a torch without ``c10d._register_pg_in_world`` (2.11 here on the GPU image). On this
    torch, which has both, a group registered each way must land in c10d's tables alike."""
    from pitstop.pg import Fence, GuardedGroup, _register_pg_in_world_compat

    mapping = {3: 0, 5: 1}
    a = GuardedGroup(None, 0, 2, "t:a", Fence(), kind="tp", backend="gloo")
    b = GuardedGroup(None, 0, 2, "t:b", Fence(), kind="tp", backend="gloo")
    c10d._register_pg_in_world(a, backend_name=a.getBackendName(), store=None, group_name="t:a",
                               backend_config=a.getBackendName(), rank_mapping=mapping)
    _register_pg_in_world_compat(b, "t:b", mapping)
    w = c10d._world
    try:
        assert w.pg_map[b] == w.pg_map[a] and w.pg_backend_config[b] == w.pg_backend_config[a]
        assert (w.pg_names[a], w.pg_names[b]) == ("t:a", "t:b")
        assert w.pg_group_ranks[b] == w.pg_group_ranks[a] == mapping
        assert (w.pg_to_tag[a], w.pg_to_tag[b]) == ("ptd:t:a", "ptd:t:b")
        assert w.tags_to_pg["ptd:t:b"] == [b] and w.tags_to_pg["ptd:t:a"] == [a]
        assert c10d._resolve_process_group("t:b") is b
    finally:
        for pg, name in ((a, "t:a"), (b, "t:b")):
            for table in (w.pg_map, w.pg_names, w.pg_backend_config, w.pg_group_ranks, w.pg_to_tag):
                table.pop(pg, None)
            w.tags_to_pg.pop("ptd:" + name, None)
            c10d._unregister_process_group(name)


def test_rename_moves_a_group_in_every_c10d_table_and_never_takes_a_held_name():
    """A group installed under its stable name resolves by it, keeps its generation's name as
    ``uid``, and moves its tag; a name another live group holds is refused, changing nothing."""
    from pitstop.pg import Fence, GuardedGroup, register_python_group, rename

    w = c10d._world
    a = GuardedGroup(None, 0, 2, "t:g0:tp:a", Fence(), kind="tp", backend="gloo")
    b = GuardedGroup(None, 0, 2, "t:g1:tp:b", Fence(), kind="tp", backend="gloo")
    register_python_group(a, "t:g0:tp:a", [3, 5], "tp")
    register_python_group(b, "t:g1:tp:b", [3, 5], "tp")
    try:
        assert rename(a, "t:tp") is True
        assert (a.group_name, a.uid, w.pg_names[a], w.pg_to_tag[a]) == ("t:tp", "t:g0:tp:a", "t:tp", "ptd:t:tp")
        assert c10d._resolve_process_group("t:tp") is a and "ptd:t:g0:tp:a" not in w.tags_to_pg
        assert rename(b, "t:tp") is False  # held by a: b keeps its name, nothing moved
        assert (b.group_name, w.pg_names[b]) == ("t:g1:tp:b", "t:g1:tp:b")
        assert c10d._resolve_process_group("t:tp") is a
        assert rename(a, "t:tp") is True  # already its name
    finally:
        for pg in (a, b):
            name = w.pg_names.get(pg)
            for table in (w.pg_map, w.pg_names, w.pg_backend_config, w.pg_group_ranks, w.pg_to_tag):
                table.pop(pg, None)
            if name is not None:
                w.tags_to_pg.pop("ptd:" + name, None)
                c10d._unregister_process_group(name)


@pytest.mark.timeout(120)
def test_world_group_composites_and_bad_replace(job, tmp_path):
    world = 4
    ctx = job.start("pg", [WORKER, str(tmp_path)], range(world), world)
    wait_done(job, ctx, timeout=100)
    for r in range(world):
        res = json.loads((tmp_path / f"result_{r}.json").read_text())
        assert res["world_sum"] == [10.0, 60.0]
        assert res["world_max"] == 3.0
        assert res["world_bcast"] == 7.0
        assert res["world_gather"] == [[i, i * i] for i in range(world)]
        assert res["composite_type"] == "CompositeGroup"
        assert res["composite_sum"] == 15.0  # 1 + 2 + 4 + 8: every rank, each once
        assert res["composite_max"] == 3.0
        # 40 seeded one-element sums: all as a flat gloo group adds them; inner-then-outer would not
        same_flat, same_two_step = res["composite_sum_as_flat"]
        assert same_flat == 40 and same_two_step < 40, res["composite_sum_as_flat"]
        assert res["composite_ranks"] == [0, 1, 2, 3] and res["composite_rank"] == r
        assert "allgather" in res["composite_gather_error"] and "tp-dp" in res["composite_gather_error"]
        assert "role(7) does not exist" in res["bad_replace"] and "0..3" in res["bad_replace"]
        assert res["untouched"] is True and res["generation"] == 0
        assert res["after_destroy_dp_sum"] == 2.0


@pytest.mark.timeout(180)
def test_compiled_code_survives_a_replacement_because_group_names_are_stable(job, tmp_path):
    """``torch.compile`` guards a collective on its group's ``group_name``. Each generation's
    groups are built under unique names (their store keys must not collide) and installed
    under stable ones (``pitstop:tp``), so a rebuilt group, and a joiner's group against the
    one it compiled with before, pass the guard: one graph per rank, no recompile, and the
    collective runs on the new communicator."""
    world = 4
    ctx = job.start("pg-compiled", [WORKER, str(tmp_path), "compiled-replace"], range(world), world)
    wait_done(job, ctx, timeout=160)
    res = [json.loads((tmp_path / f"result_{r}.json").read_text()) for r in range(world)]
    for r, x in enumerate(res):
        assert x["names"] == ["pitstop:tp", "pitstop:tp"], x
        assert x["resolves"] is True, x
        assert x["graphs"] == 1, f"rank {r} recompiled: {x}"
        assert x["uid"].startswith("pitstop:g1:tp:" if r in (2, 3) else "pitstop:g0:tp:"), x
        pair = (0, 1) if r < 2 else (2, 3)
        assert x["sums"] == [sum(2.0 * (p + 1) for p in pair) + 1, sum(20.0 * (p + 1) for p in pair) + 1], x
    assert [res[r].get("tp_rebuilt") for r in range(3)] == [False, False, True]


@pytest.mark.timeout(120)
def test_background_prepare_does_not_wait_behind_the_training_threads_store_call(job, tmp_path):
    """The cause of a drain that hung for 120 s: a c10d TCPStore client holds its lock for
    the whole of a blocking wait, so a drain's background prepare must not rendezvous over
    the training thread's connection. Here each stayer's main thread waits (20 s limit) for
    a key that its own prepare sets when done; on the main thread's connection that is a
    deadlock."""
    world = 4
    ctx = job.start("pg-bg", [WORKER, str(tmp_path), "background-prepare"], range(world), world)
    wait_done(job, ctx, timeout=100)
    for r in range(world):
        res = json.loads((tmp_path / f"result_{r}.json").read_text())
        assert res["generation"] == 1, res
        assert res["dp_ranks"] == ([0, 2] if r % 2 == 0 else [1, 3]), res
        assert res["dp_sum"] == (1.0 + 3.0 if r % 2 == 0 else 2.0 + 4.0), res
        if r < world - 1:
            assert res["main_wait_error"] is None and res["prepare_error"] is None, res
            assert res["prepare_s"] < 15, res



@pytest.mark.timeout(120)
def test_a_joiners_deferred_groups_exist_at_once_and_talk_after_attach(job, tmp_path):
    """A joiner builds its model while its communicators rendezvous in the background:
    ``build()`` returns before any stayer has started (they wait for it), the group objects
    answer locally while the fence is local, refuse an operation by name while the fence
    is open and nothing is attached, and after ``attach`` the same objects reduce with the
    stayers, whose side was built concurrently."""
    world = 4
    ctx = job.start("pg-deferred", [WORKER, str(tmp_path), "deferred-joiner"], range(world), world)
    wait_done(job, ctx, timeout=100)
    res = [json.loads((tmp_path / f"result_{r}.json").read_text()) for r in range(world)]
    j = res[3]
    assert j["deferred_after_build"] is True and j["deferred_after_attach"] is False, j
    assert j["dp_ranks_before_attach"] == [1, 3], j
    assert j["local_allreduce"] == 5.0, j
    assert j["open_before_attach"] and "still being built" in j["open_before_attach"], j
    assert j["same_object"] is True, j
    for r in res:
        assert r["generation"] == 1 and r["generation_2"] == 2, r
        assert r["dp_sum"] == r["dp_sum_2"] == (1.0 + 3.0 if r["rank"] % 2 == 0 else 2.0 + 4.0), r
        assert r["tp_sum"] == (1.0 + 2.0 if r["rank"] < 2 else 3.0 + 4.0), r
    # the one store connection the rendezvous share is opened when the groups are built (or by
    # the standby while it waits), none during a replacement: a new connection costs the
    # store's server a reverse DNS lookup that stalls the whole job when its answer is lost.
    # Every rank rebuilt 3 or more communicators at once, over that one connection.
    for r in res[:3]:
        assert r["rendezvous"] >= 3, r  # tp, dp, and the rest of this rank's kinds
        assert r["opened_at_build"] == r["opened_after_1"] == r["opened_after_2"] == 1, r
        assert r["pool_after_1"] == r["pool_after_2"] == 1, r
    assert j["joiner_opened"] == j["joiner_spare"] == 1, j


@pytest.mark.timeout(120)
def test_an_operation_blocked_by_a_dead_peer_gives_up_when_its_group_is_marked_broken(job, tmp_path):
    """A gloo reduce-scatter (whose own wait ignores timeouts) and a world all-reduce through
    the store, each blocked on a rank that never comes: marked broken 0.5 s in, each returns
    within seconds, not at the 60 s timeout, with the step's fence saying why."""
    ctx = job.start("pg-abandon", [WORKER, str(tmp_path), "abandon"], range(2), 2)
    wait_done(job, ctx, timeout=100)
    r = json.loads((tmp_path / "result_0.json").read_text())
    for name in ("reduce_scatter", "world"):
        assert 0.4 < r[f"{name}_s"] < 10, r
        assert any("abandoned" in e for e in r[f"{name}_errors"]), r
    assert r["world_broken_after_rewind"] is False, r


def test_python_groups_define_every_c10d_method_from_one_table():
    """The guarded group and the virtual backend take their methods from ``C10D_METHODS``;
    each name there must exist on torch's ProcessGroup (else the table is stale) and be
    the Python group's own, not the C++ base's (else the call would fail there)."""
    from pitstop.pg import C10D_METHODS, GuardedGroup
    from pitstop.virtual import VirtualGroup

    assert len(set(C10D_METHODS)) == len(C10D_METHODS)
    missing = [m for m in C10D_METHODS if not hasattr(dist.ProcessGroup, m)]
    assert not missing, f"torch's ProcessGroup no longer has {missing}"
    for cls in (GuardedGroup, VirtualGroup):
        for m in C10D_METHODS:
            assert m in cls.__dict__, f"{cls.__name__}.{m} would reach the C++ base"
    # every reduce-scatter of the table is waited on in a helper thread (gloo's wait ignores
    # the timeout there, see the dead-peer test); a new variant upstream must be added too
    from pitstop.pg import _WAIT_IN_THREAD

    assert {m for m in C10D_METHODS if "reduce_scatter" in m} <= set(_WAIT_IN_THREAD)


def test_the_world_groups_wire_form_carries_0_dim_and_empty_tensors():
    """DeepSpeed's ZeRO-3 broadcasts scalars and empty tensors over the world group: their bytes
    go through the store and come back as the receive side reads them; a wrong size is refused."""
    import torch

    from pitstop.pg import _raw

    from pitstop.errors import GroupError
    from pitstop.pg import _tensor

    for t in (torch.tensor(7, dtype=torch.int64), torch.tensor(2.5), torch.arange(6.0).reshape(2, 3),
              torch.empty(0, 4)):  # ... and empty ones (a ZeRO-3 partition can be)
        back = _tensor(bytearray(_raw(t)), t)
        assert back.shape == t.shape and back.dtype == t.dtype and torch.equal(back, t)
    with pytest.raises(GroupError, match="7 bytes for a torch.int64 tensor of shape"):
        _tensor(bytearray(7), torch.tensor(1))


def test_until_released_waits_for_the_thread_that_still_holds_the_work():
    """With memory tracked, a finished gloo work is waited on until its worker thread has let
    go of it (:func:`pitstop.pg._until_released`), else its tensors die in that thread at a
    moment that varies run to run and a counted peak varies by one buffer. Here an autograd
    graph stands in for the work (it holds references to the tensor's impl, as the work's
    tensor list does), dropped by another thread 0.1 s later."""
    import threading
    import time

    import torch

    from pitstop.pg import _until_released

    t = torch.zeros(16, requires_grad=True)
    alone = t._use_count()
    box = {"graph": (t * t).sum()}  # mul saves t for its backward
    held = t._use_count()
    assert held > alone, (held, alone)

    def release():
        time.sleep(0.1)
        box.clear()

    th = threading.Thread(target=release)
    t0 = time.monotonic()
    th.start()
    _until_released(t, held, "test")
    waited = time.monotonic() - t0
    th.join()
    assert t._use_count() == alone and waited >= 0.09, (t._use_count(), alone, waited)
    t0 = time.monotonic()
    _until_released(t, held, "test")  # already released: at once
    assert time.monotonic() - t0 < 0.05


def test_the_tap_set_through_the_package_is_the_one_the_operations_read():
    """``pitstop.pg`` is a package of one module per concern; ``pitstop.pg.TAP = f`` (the
    recorder's and the sandbox's spelling) must set :data:`pitstop.pg.tap.TAP`, which the
    world and guarded groups read, not a shadow attribute of the package."""
    import pitstop.pg as pgpkg
    from pitstop.pg import tap

    def hook(kind, what, args):  # noqa: ARG001
        return None

    assert pgpkg.TAP is None and tap.TAP is None
    pgpkg.TAP = hook
    try:
        assert tap.TAP is hook and pgpkg.TAP is hook
        assert "TAP" not in vars(pgpkg)
        assert tap._tapped("world", "barrier", ()) is None
    finally:
        pgpkg.TAP = None
    assert tap.TAP is None

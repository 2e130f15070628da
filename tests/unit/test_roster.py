"""Tier 1: the roster (role -> process, per generation). Pure data."""

from __future__ import annotations

import json

import pytest

from pitstop.errors import RosterError
from pitstop.roster import ProcessInfo, Roster

ROLES = tuple(ProcessInfo(f"host{i // 4}", 100 + i, f"host{i // 4}:{29500 + i}") for i in range(8))
SPARE_A = ProcessInfo("spare", 500, "spare:29600")
SPARE_B = ProcessInfo("spare", 501)


@pytest.fixture
def r0():
    return Roster(3, ROLES, (SPARE_A, SPARE_B))


def test_replace_bumps_generation_and_takes_standby(r0):
    r1 = r0.replace(5, SPARE_A)
    assert r1.generation == 4 and r0.generation == 3
    assert r1.roles[5] == SPARE_A and r0.roles[5] == ROLES[5]
    assert r1.roles[:5] == ROLES[:5] and r1.roles[6:] == ROLES[6:]
    assert r1.standbys == (SPARE_B,)
    assert r0.standbys == (SPARE_A, SPARE_B)  # immutable
    # A process that was not a standby may take a role too; the pool is untouched.
    fresh = ProcessInfo("new", 7)
    r2 = r1.replace(0, fresh)
    assert r2.generation == 5 and r2.roles[0] == fresh and r2.standbys == (SPARE_B,)


@pytest.mark.parametrize("role", [8, -1, 100, True, "3", None])
def test_replace_role_out_of_range(r0, role):
    with pytest.raises(RosterError) as e:
        r0.replace(role, SPARE_A)
    msg = str(e.value)
    assert f"role({role!r})" in msg and "0..7" in msg
    assert isinstance(e.value, ValueError)


def test_replace_refuses_a_process_that_has_a_role(r0):
    with pytest.raises(RosterError) as e:
        r0.replace(3, ROLES[5])
    assert "role 5" in str(e.value) and "role 3" in str(e.value)
    assert ROLES[5].describe() in str(e.value)
    with pytest.raises(RosterError):
        r0.replace(3, ROLES[3])  # already playing this very role
    r1 = r0.replace(2, SPARE_A)
    with pytest.raises(RosterError, match="role 2"):
        r1.replace(6, SPARE_A)  # the standby now has a role


def test_json_round_trip(r0):
    r1 = r0.replace(5, SPARE_A).with_standby(ProcessInfo("late", 9))
    text = r1.to_json()
    d = json.loads(text)
    assert d["generation"] == 5 and len(d["roles"]) == 8
    assert d["roles"][5] == {"host": "spare", "pid": 500, "addr": "spare:29600"}
    back = Roster.from_json(text)
    assert back == r1 and back.to_json() == text
    assert isinstance(back.roles, tuple) and isinstance(back.standbys, tuple)
    # standbys may be absent in older payloads
    assert Roster.from_json(json.dumps({"generation": 0, "roles": []})) == Roster(0, ())


def test_changed_roles(r0):
    assert r0.changed_roles(r0) == ()
    r2 = r0.replace(5, SPARE_A).replace(2, SPARE_B)
    assert r0.changed_roles(r2) == (2, 5)
    assert r2.changed_roles(r0) == (2, 5)
    assert r0.changed_roles(r0.with_standby(ProcessInfo("x", 1))) == ()
    with pytest.raises(RosterError, match="8.*4"):
        r0.changed_roles(Roster(0, ROLES[:4]))


def test_with_standby(r0):
    p = ProcessInfo("late", 9)
    r1 = r0.with_standby(p)
    assert r1.generation == r0.generation + 1 and r1.standbys == (SPARE_A, SPARE_B, p)
    assert r1.roles == r0.roles
    with pytest.raises(RosterError):
        r0.with_standby(ROLES[0])
    with pytest.raises(RosterError):
        r0.with_standby(SPARE_A)


def test_duplicate_process_refused():
    with pytest.raises(RosterError) as e:
        Roster(0, (ROLES[0], ROLES[1], ROLES[0]))
    assert "role 0" in str(e.value) and "role 2" in str(e.value)
    with pytest.raises(RosterError, match="standby"):
        Roster(0, ROLES, (ROLES[4],))
    with pytest.raises(RosterError, match="standby"):
        Roster(0, ROLES, (SPARE_A, SPARE_A))


def test_negative_generation_refused():
    with pytest.raises(RosterError, match=r"generation\(-1\)"):
        Roster(-1, ROLES)


def test_world_size_and_describe(r0):
    assert r0.world_size == 8 and Roster(0, ()).world_size == 0
    assert ProcessInfo("h", 1).describe() == "h:1"
    assert ProcessInfo("h", 1, "h:2").describe() == "h:1@h:2"


def test_replace_many_is_one_generation_for_a_machine(r0):
    """A machine's two roles change together: one generation, both standbys leave the pool."""
    r1 = r0.replace_many({4: SPARE_A, 5: SPARE_B})
    assert r1.generation == 4 and r1.roles[4] == SPARE_A and r1.roles[5] == SPARE_B and r1.standbys == ()
    assert r0.changed_roles(r1) == (4, 5)
    with pytest.raises(RosterError, match="one process for two roles"):
        r0.replace_many({4: SPARE_A, 5: SPARE_A})
    with pytest.raises(RosterError, match="already plays role 1"):
        r0.replace_many({4: ROLES[1]})
    with pytest.raises(RosterError, match="no role"):
        r0.replace_many({})
    with pytest.raises(RosterError, match="role.8. does not exist"):
        r0.replace_many({8: SPARE_A})

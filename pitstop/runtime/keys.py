"""Names of the control store's keys: the whole protocol between controller and workers, in one place.

``g`` is a roster generation, ``s`` a step, ``i`` an applicant slot.
"""

ROSTER = "ctl/roster"                       # JSON Roster, rewritten on every change
JOIN_COUNT = "ctl/join/n"                   # applicants take slots 1, 2, ...
DONE = "ctl/done"                           # set when the job is over: standbys leave
DRAIN_REQUEST = "ctl/drain/request"         # counter; payload under ctl/drain/request/<n>
COMMITTED = "ctl/committed"                 # "g:s" of the last committed step
FAULT_FIRED = "ctl/fault/fired"             # time.time() a fault injector fired at
WARM_ALL = "ctl/warm-all"                   # set once every standby of the first pool finished its warmup


def join(i: int, what: str) -> str:        # hello | nonce | mac | verdict
    return f"ctl/join/{i}/{what}"


def assign(slot: int) -> str:              # the role a standby takes (JSON)
    return f"ctl/assign/{slot}"


def heartbeat(slot: int) -> str:
    return f"ctl/hb/{slot}"


def arrive(g: int, s: int) -> str:
    return f"ctl/arrive/g{g}/s{s}"


def verdict(g: int, s: int) -> str:        # "ok" | "switch" | "poisoned ..." | fault JSON
    return f"ctl/verdict/g{g}/s{s}"


def fault(g: int) -> str:                  # JSON: what replaces the failed role of generation g
    return f"ctl/fault/g{g}"


def drain(g: int) -> str:                  # JSON: a planned switch out of generation g
    return f"ctl/drain/g{g}"


def drain_ready(g: int) -> str:
    return f"ctl/drain/g{g}/ready"


def drain_nready(g: int) -> str:
    return f"ctl/drain/g{g}/nready"


def drain_switch(g: int) -> str:           # the step after which the switch happens
    return f"ctl/drain/g{g}/switch"


def timing(g: int, who: str) -> str:       # JSON timings a worker reports for the change to generation g
    return f"ctl/timing/g{g}/{who}"


def drain_payload(n: int) -> str:
    return f"ctl/drain/request/{n}"


def record(cls: str) -> str:               # JSON {path, bytes, ops, role}: the warmup record of a role class
    return f"ctl/record/{cls}"


def warm(slot: int) -> str:                # JSON: what a standby's sandboxed warmup did
    return f"ctl/warm/{slot}"


RECORD_CLASSES = "ctl/record/classes"      # JSON list of the layout's role classes, set by the recorders

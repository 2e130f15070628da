"""Names of the control store's keys: the whole protocol between controller and workers, in one place.

``g`` is a roster generation, ``s`` a step, ``i`` a process slot (the controller
numbers every process it starts, and every applicant it admits).

Every value under these names is sealed (:mod:`pitstop.protocol`): an HMAC under
the job token over the key and the JSON body. The counters and vote slots marked
*private* are used through ``Channel.add`` / ``Channel.vote``, which append a
token-derived suffix to the name, because ``add`` and ``compare_set`` cannot carry
a MAC. The only keys a process without the token can usefully write are the
applicants' ``ctl/apply/...``, and what it writes there is refused.
"""

ROSTER = "ctl/roster"                       # sealed Roster JSON, rewritten on every change (for `pitstop status` readers)
APPLY_COUNT = "ctl/apply/n"                 # public counter: processes the controller did not start apply here
DONE = "ctl/done"                           # sealed flag: the job is over, standbys leave
DRAIN_REQUEST = "ctl/drain/request"         # private counter; sealed payload under ctl/drain/request/<n>
COMMITTED = "ctl/committed"                 # sealed {generation, step, time} of the last committed step
FAULT_FIRED = "ctl/fault/fired"             # sealed {time} a fault injector fired at
WARM_ALL = "ctl/warm-all"                   # sealed flag: every standby of the first pool finished its warmup
RECORD_CLASSES = "ctl/record/classes"       # sealed {classes}: the layout's role classes, set by the recorders
LAYOUT = "ctl/layout"                       # sealed: the job's parallel layout and shard group kind, set by rank 0
CHECKPOINT = "ctl/checkpoint"               # sealed {dir, marker}: the script's own checkpoints (Megatron-LM --save), set by rank 0
NODE_LINK = "ctl/node/link"                 # sealed {host, port}: where machines' agents open their link (launch.link)
CONTROLLER_STATE = "ctl/controller/state"   # sealed: the controller's own state, for a restarted one (etcd only)


def join(i: int, what: str) -> str:        # hello | verdict, of a process the controller started as slot i
    return f"ctl/join/{i}/{what}"


def apply(i: int, what: str) -> str:       # hello | verdict, of the i-th applicant the controller did not start
    return f"ctl/apply/{i}/{what}"


def assign(slot: int) -> str:              # sealed: the role a standby takes
    return f"ctl/assign/{slot}"


def heartbeat(slot: int) -> str:           # sealed {n}: n must grow
    return f"ctl/hb/{slot}"


def arrive(g: int, s: int) -> str:         # private counter: ranks that reached the boundary
    return f"ctl/arrive/g{g}/s{s}"


def verdict(g: int, s: int) -> str:        # private vote: "ok" | "switch" | "poisoned ..." | fault JSON
    return f"ctl/verdict/g{g}/s{s}"


def fault(g: int) -> str:                  # sealed: what replaces the failed role of generation g
    return f"ctl/fault/g{g}"


def drain(g: int) -> str:                  # sealed: a planned switch out of generation g
    return f"ctl/drain/g{g}"


def ended(g: int) -> str:                  # sealed stamp: fault(g) or drain(g) was written (what workers wait on)
    return f"ctl/ended/g{g}"


def drain_ready(g: int) -> str:            # sealed flag
    return f"ctl/drain/g{g}/ready"


def drain_nready(g: int) -> str:           # private counter
    return f"ctl/drain/g{g}/nready"


def drain_switch(g: int) -> str:           # sealed {step, time}: the step after which the switch happens
    return f"ctl/drain/g{g}/switch"


def timing(g: int, who: str) -> str:       # sealed timings a worker reports for the change to generation g
    return f"ctl/timing/g{g}/{who}"


def drain_payload(n: int) -> str:          # sealed {rank, host}
    return f"ctl/drain/request/{n}"


def record(cls: str) -> str:               # sealed {cls, role, path, bytes, ...}: the warmup record of a role class
    return f"ctl/record/{cls}"


def warm(slot: int) -> str:                # sealed: what a standby's sandboxed warmup did
    return f"ctl/warm/{slot}"


def node(k: int, what: str) -> str:        # hello | hb | probe | pong: machine k's agent (sealed)
    return f"ctl/node/{k}/{what}"


def node_cmd(k: int, n: int) -> str:       # sealed: the controller's n-th command to machine k's agent
    return f"ctl/node/{k}/cmd/{n}"


def node_event(k: int, name: str, what: str) -> str:  # started | exit | hung: a process machine k's agent runs
    return f"ctl/node/{k}/{what}/{name}"


def all_patterns(generations=(0, 1, 2), steps=range(0, 12), slots=range(0, 16)):
    """Every concrete key name of this module for small parameters (the fuzz test's target list)."""
    out = [ROSTER, APPLY_COUNT, DONE, DRAIN_REQUEST, COMMITTED, FAULT_FIRED, WARM_ALL, RECORD_CLASSES, LAYOUT, NODE_LINK,
           CONTROLLER_STATE, CHECKPOINT]
    for i in slots:
        out += [join(i, "hello"), join(i, "verdict"), apply(i, "hello"), apply(i, "verdict"),
                assign(i), heartbeat(i), warm(i), drain_payload(i)]
    for g in generations:
        out += [fault(g), drain(g), ended(g), drain_ready(g), drain_nready(g), drain_switch(g)]
        out += [timing(g, w) for w in ("joiner", "leaver")] + [timing(g, f"r{r}") for r in range(8)]
        out += [timing(g, f"it{r}") for r in range(8)]
        for s in steps:
            out += [arrive(g, s), verdict(g, s)]
    out += [record(c) for c in ("only", "first", "middle", "last")]
    for k in range(5):
        out += [node(k, "hello"), node(k, "hb"), node(k, "probe"), node(k, "pong")] + [node_cmd(k, n) for n in range(1, 6)]
        out += [node_event(k, f"w{r}", w) for r in range(8) for w in ("started", "exit", "hung")]
    return out

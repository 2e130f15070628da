"""Chakra execution traces of the target-scale graph, for ASTRA-sim and other Chakra readers.

mlcommons' ``chakra`` Python package is not on PyPI (it installs from git, with a dependency
that is git-only too), so pitstop writes Chakra's wire form itself, with the ``protobuf``
runtime. The messages below are those of Chakra's ``schema/protobuf/et_def.proto``
(package ``ChakraProtoMsg``), declared with the same names, types and field numbers; only the
fields pitstop fills are declared (a reader skips nothing: an absent field is its default).

Files, as Chakra's own ``protolib.encodeMessage`` frames them::

    <prefix>.<rank>.et         per rank: GlobalMetadata, then one Node per operation, each
                               message preceded by its length as a varint
    <prefix>.comm_groups.json  {pg_name: [ranks]}: ASTRA-sim's --comm-group-configuration

Per operation of the replayed graph (every iteration, in program order; each node depends
on the one before it, as the replay runs a rank's operations one at a time)::

    Compute            COMP_NODE       duration_micros = its measured time
    collective on G    COMM_COLL_NODE  comm_type, comm_size (bytes), pg_name (G's id)
    send / recv        COMM_SEND_NODE / COMM_RECV_NODE
                                       comm_dst / comm_src (global rank), comm_size, comm_tag
                                       (the message's index on that channel: a recv's tag
                                       equals its matching send's)

``start_time_micros`` and, for communication, ``duration_micros`` come from the replay.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from pitstop.errors import EmulationError
from pitstop.emulation.graph import Compute

#: Chakra's schema version these files follow (its GlobalMetadata.version).
SCHEMA_VERSION = "0.0.4"

# ChakraProtoMsg.NodeType
METADATA_NODE, COMP_NODE, COMM_SEND_NODE, COMM_RECV_NODE, COMM_COLL_NODE = 1, 4, 5, 6, 7
#: torch.distributed collective -> ChakraProtoMsg.CollectiveCommType
COMM_TYPE = {"all_reduce": 0, "all_gather": 2, "broadcast": 5, "all_to_all": 6, "reduce_scatter": 7, "barrier": 9}

_CLASSES: Optional[Dict[str, Any]] = None


def _messages() -> Dict[str, Any]:
    """The message classes, built once from a descriptor declared here (no protoc, no .proto file)."""
    global _CLASSES
    if _CLASSES is not None:
        return _CLASSES
    try:
        from google.protobuf import descriptor_pb2, message_factory
    except ImportError:  # pragma: no cover - the extra names the fix
        from pitstop.errors import MissingDependencyError

        raise MissingDependencyError("Chakra export needs the protobuf runtime: pip install 'pitstop[chakra]'") from None
    F = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="pitstop_chakra_et_def.proto", package="ChakraProtoMsg",
                                             syntax="proto3")

    def message(name: str, fields: Iterable[Tuple[str, int, int, int, str]], oneof: Optional[str] = None) -> None:
        m = fdp.message_type.add(name=name)
        if oneof:
            m.oneof_decl.add(name=oneof)
        for fname, number, ftype, label, type_name in fields:
            f = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                f.type_name = f".ChakraProtoMsg.{type_name}"
            if oneof and number >= 3:
                f.oneof_index = 0

    opt, rep = F.LABEL_OPTIONAL, F.LABEL_REPEATED
    message("AttributeProto", [
        ("name", 1, F.TYPE_STRING, opt, ""), ("doc_string", 2, F.TYPE_STRING, opt, ""),
        ("double_val", 3, F.TYPE_DOUBLE, opt, ""), ("int32_val", 7, F.TYPE_INT32, opt, ""),
        ("int64_val", 9, F.TYPE_INT64, opt, ""), ("uint64_val", 13, F.TYPE_UINT64, opt, ""),
        ("bool_val", 27, F.TYPE_BOOL, opt, ""), ("string_val", 29, F.TYPE_STRING, opt, ""),
    ], oneof="value")
    message("GlobalMetadata", [("version", 1, F.TYPE_STRING, opt, ""), ("attr", 2, F.TYPE_MESSAGE, rep, "AttributeProto")])
    message("IOInfo", [("values", 1, F.TYPE_STRING, opt, ""), ("shapes", 2, F.TYPE_STRING, opt, ""),
                       ("types", 3, F.TYPE_STRING, opt, "")])
    nt = fdp.enum_type.add(name="NodeType")
    for name, number in (("INVALID_NODE", 0), ("METADATA_NODE", 1), ("MEM_LOAD_NODE", 2), ("MEM_STORE_NODE", 3),
                         ("COMP_NODE", 4), ("COMM_SEND_NODE", 5), ("COMM_RECV_NODE", 6), ("COMM_COLL_NODE", 7)):
        nt.value.add(name=name, number=number)
    message("Node", [
        ("id", 1, F.TYPE_UINT64, opt, ""), ("name", 2, F.TYPE_STRING, opt, ""),
        ("ctrl_deps", 4, F.TYPE_UINT64, rep, ""), ("data_deps", 5, F.TYPE_UINT64, rep, ""),
        ("start_time_micros", 6, F.TYPE_UINT64, opt, ""), ("duration_micros", 7, F.TYPE_UINT64, opt, ""),
        ("inputs", 8, F.TYPE_MESSAGE, opt, "IOInfo"), ("outputs", 9, F.TYPE_MESSAGE, opt, "IOInfo"),
        ("attr", 10, F.TYPE_MESSAGE, rep, "AttributeProto"),
    ])
    node = fdp.message_type[-1]
    t = node.field.add(name="type", number=3, type=F.TYPE_ENUM, label=opt)
    t.type_name = ".ChakraProtoMsg.NodeType"
    classes = message_factory.GetMessages([fdp])
    _CLASSES = {k.split(".")[-1]: v for k, v in classes.items()}
    return _CLASSES


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        bits = n & 0x7F
        n >>= 7
        if n:
            out.append(0x80 | bits)
        else:
            out.append(bits)
            return bytes(out)


def group_ids(result: Any) -> Tuple[Dict[Tuple[str, Tuple[int, ...]], str], Dict[str, List[int]]]:
    """Every communicator a collective of the graph uses, numbered: (kind, ranks) -> pg_name,
    and pg_name -> ranks (the comm-group file)."""
    ids: Dict[Tuple[str, Tuple[int, ...]], str] = {}
    groups: Dict[str, List[int]] = {}
    graph = result.graph
    kinds = sorted({op.group_kind for prog in graph.programs.values() for it in prog for op in it
                    if not isinstance(op, Compute) and not op.is_p2p})
    for kind in kinds:
        for g in graph.group_table(kind).groups:
            key = (kind, tuple(g))
            if key not in ids:
                ids[key] = str(len(ids))
                groups[ids[key]] = list(g)
    return ids, groups


def export(result: Any, prefix: Path, ranks: Optional[Sequence[int]] = None) -> Dict[str, Any]:
    """Write ``result``'s graph as Chakra execution traces (see the module docstring); returns
    what was written. ``ranks``: whose files (default every rank of the world)."""
    msg = _messages()
    Node, Attr, Meta = msg["Node"], msg["AttributeProto"], msg["GlobalMetadata"]
    graph = result.graph
    world = graph.world_size
    ranks = list(range(world)) if ranks is None else list(ranks)
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise EmulationError(f"chakra export: rank(s) {bad[:5]} outside the world 0..{world - 1}")
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    ids, groups = group_ids(result)
    (prefix.parent / f"{prefix.name}.comm_groups.json").write_text(json.dumps(groups))
    nodes = 0
    total = 0
    meta = Meta(version=SCHEMA_VERSION, attr=[
        Attr(name="source", string_val="pitstop emulate"),
        Attr(name="world_size", int64_val=world),
        Attr(name="layout", string_val=graph.layout.describe()),
        Attr(name="topology", string_val=result.topology.name),
    ]).SerializeToString()
    for rank in ranks:
        out = bytearray(_varint(len(meta)) + meta)
        sent: Dict[int, int] = {}
        got: Dict[int, int] = {}
        prev: Optional[int] = None
        for nid, t in enumerate(result.timeline(rank)):
            op = t.op
            start = int(round(t.start * 1e6))
            if isinstance(op, Compute):
                n = Node(id=nid, name=op.name or "compute", type=COMP_NODE, start_time_micros=start,
                         duration_micros=int(round(op.duration_s * 1e6)),
                         attr=[Attr(name="is_cpu_op", bool_val=False)])
            else:
                target = graph.target(rank, op)
                dur = int(round((t.end - t.start - t.wait) * 1e6))
                common = [Attr(name="is_cpu_op", bool_val=False), Attr(name="comm_size", int64_val=int(op.nbytes))]
                if op.is_p2p:  # the k-th message on a channel has tag k on both of its ends
                    counts, ntype, peer, words = ((sent, COMM_SEND_NODE, "comm_dst", "send to") if op.op == "send"
                                                  else (got, COMM_RECV_NODE, "comm_src", "recv from"))
                    k = counts.get(target, 0)
                    counts[target] = k + 1
                    n = Node(id=nid, name=f"{words} {target}", type=ntype, start_time_micros=start,
                             duration_micros=dur, attr=common + [Attr(name=peer, int32_val=int(target)),
                                                                 Attr(name="comm_tag", int32_val=k)])
                else:
                    if op.op not in COMM_TYPE:
                        raise EmulationError(f"chakra export: collective {op.op!r} has no Chakra comm_type "
                                             f"(known: {', '.join(COMM_TYPE)})")
                    pg = ids[(op.group_kind, tuple(target))]
                    n = Node(id=nid, name=f"{op.op} {op.group_kind}", type=COMM_COLL_NODE, start_time_micros=start,
                             duration_micros=dur, attr=common + [Attr(name="comm_type", int64_val=COMM_TYPE[op.op]),
                                                                 Attr(name="pg_name", string_val=pg)])
            if prev is not None:
                n.data_deps.append(prev)
            prev = nid
            body = n.SerializeToString()
            out += _varint(len(body))
            out += body
            nodes += 1
        path = prefix.parent / f"{prefix.name}.{rank}.et"
        path.write_bytes(bytes(out))
        total += len(out)
    return {"prefix": str(prefix), "ranks": len(ranks), "nodes": nodes, "bytes": total, "comm_groups": len(groups),
            "schema_version": SCHEMA_VERSION}


def read(path: Path) -> Tuple[Any, List[Any]]:
    """One rank's file back: (GlobalMetadata, [Node, ...]), as Chakra's ``protolib.decodeMessage``
    reads it: a varint length, then that many bytes, until the end."""
    msg = _messages()
    data = Path(path).read_bytes()
    pos, out = 0, []
    while pos < len(data):
        size, shift = 0, 0
        while True:
            if pos >= len(data):
                raise EmulationError(f"{path}: truncated length at byte {pos}")
            b = data[pos]
            pos += 1
            size |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        if pos + size > len(data):
            raise EmulationError(f"{path}: a message of {size} bytes at byte {pos} runs past the end ({len(data)})")
        out.append(data[pos:pos + size])
        pos += size
    if not out:
        raise EmulationError(f"{path}: empty")
    meta = msg["GlobalMetadata"]()
    meta.ParseFromString(out[0])
    nodes = []
    for raw in out[1:]:
        n = msg["Node"]()
        n.ParseFromString(raw)
        nodes.append(n)
    return meta, nodes

"""The scheduler's and the projector's loops against hostile records.

Every record is proven (a tenant's request, a node's event), so the bytes reach the
decoders and the rules behind the proof: what a tenant or a compromised client can
send. Whatever they hold, the loop returns, the record ends as a refusal or a dead
letter, and the good requests of the same batch are all answered.
"""

from __future__ import annotations

import json
from itertools import count
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.config import Settings
from app.control.dispatch import Dispatcher
from app.control.outbox import Outbox
from app.control.projector import admit_event
from app.domain.codec import DecodeError, encode
from app.domain.events import NodeHeartbeat, NodePayload
from app.domain.proof import Purpose, headers
from app.domain.records import Inbound
from app.domain.requests import CreateSandbox, Exec, WriteFile
from tests.unit.signing import KEYS, PARTITIONS, record, reply_to

_offsets = count()

_TENANT = KEYS.lookup("k-tenant-t")
_NODE = KEYS.lookup("k-node-n0")
assert _TENANT is not None and _NODE is not None


def _signed(value: bytes, key: str, secret: bytes, purpose: Purpose, rkey: bytes) -> Inbound:
    return Inbound(
        topic="t", partition=0, offset=next(_offsets), key=rkey, value=value,
        headers=headers(purpose, key, secret, value),
    )  # fmt: skip


def _dispatcher() -> Dispatcher:
    dispatcher = Dispatcher(Settings(), KEYS, PARTITIONS)
    beat = NodeHeartbeat(
        node_id="n0",
        payload=NodePayload(
            capacity_sandboxes=10_000, capacity_cpus=10_000, capacity_memory_mb=1 << 30,
            queue="node.n0",
        ),
    )  # fmt: skip
    dispatcher.observe(Outbox(), record(beat, next(_offsets)))
    return dispatcher


#: Values a hostile sender puts where a field should be.
_nasty_text = st.one_of(
    st.text(alphabet=st.characters(codec="utf-8"), max_size=40),
    st.just("\x00"),
    st.just("a\x00b"),
    st.just("\ud800"),
    st.just("x" * 70_000),
)
_nasty = st.one_of(
    _nasty_text,
    st.integers(min_value=-(10**30), max_value=10**30),
    st.just(10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.lists(st.integers(), max_size=5),
    st.just(json.loads("[" * 30 + "]" * 30)),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)

_BASES: list[dict[str, Any]] = [
    json.loads(encode(Exec(sandbox_id="sb-hostile", command="true", reply_to=reply_to()))),
    json.loads(
        encode(WriteFile(sandbox_id="sb-hostile", path="/x", data_b64="", reply_to=reply_to()))
    ),
    json.loads(encode(CreateSandbox(sandbox_id="sb-hostile", reply_to=reply_to()))),
]


@st.composite
def _hostile_json(draw: st.DrawFn) -> bytes:
    base = dict(draw(st.sampled_from(_BASES)))
    field = draw(st.sampled_from(sorted(base)))
    value = draw(_nasty)
    if field == "reply_to":
        value = {"topic": "dsec.replies.t", "partition": value}
    base[field] = value
    try:
        return json.dumps(base).encode()
    except ValueError:  # a lone surrogate: send the bytes a broken encoder would
        return json.dumps(base, ensure_ascii=False).encode("utf-8", "surrogatepass")


_hostile_bytes = st.one_of(
    st.binary(max_size=300),
    _hostile_json(),
    st.integers(1, 20_000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(1, 20_000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile=_hostile_bytes, key=st.sampled_from([b"sb-hostile", b"other", b"\xff\x00"]))
def test_a_hostile_request_costs_no_other_request_its_answer(hostile: bytes, key: bytes) -> None:
    dispatcher = _dispatcher()
    out = Outbox()
    n = next(_offsets)
    good = [
        CreateSandbox(sandbox_id=f"sb-good-{n}-{i}", reply_to=reply_to(partition=i))
        for i in range(2)
    ]
    batch = [
        record(good[0], next(_offsets)),
        _signed(hostile, "k-tenant-t", _TENANT.secret, Purpose.REQUEST, key),
        record(good[1], next(_offsets)),
    ]
    for one in batch:
        dispatcher.handle(out, one)  # never raises
    placed = {json.loads(json.loads(args[0])["request"])["sandbox_id"] for _, _, args in out.tasks}
    assert {g.sandbox_id for g in good} <= placed  # both went to their node


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=_hostile_bytes, signer=st.sampled_from(["node", "tenant", "none", "garbage"]))
def test_the_projector_takes_or_refuses_every_record(value: bytes, signer: str) -> None:
    if signer == "node":
        one = _signed(value, "k-node-n0", _NODE.secret, Purpose.EVENT, b"sb-hostile")
    elif signer == "tenant":
        one = _signed(value, "k-tenant-t", _TENANT.secret, Purpose.EVENT, b"sb-hostile")
    else:
        hdrs = [] if signer == "none" else [("dsec-key", b"\xff\x00"), ("dsec-mac", value[:80])]
        one = Inbound(topic="t", partition=0, offset=0, key=None, value=value, headers=hdrs)
    taken = admit_event(one, KEYS, 1 << 20)  # never raises
    assert isinstance(taken, DecodeError) or (
        hasattr(taken[0], "event_id") and taken[1] == "n0"  # proven by node n0
    )
    if signer != "node":
        assert isinstance(taken, DecodeError)  # only a node's proof makes an event

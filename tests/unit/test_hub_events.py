"""The hub's reports read into audit rows (app/domain/hub_events.py)."""

from __future__ import annotations

from typing import Any

from app.domain.hub_events import read_envelope


def _event(action: str, **target: Any) -> dict[str, Any]:
    return {
        "id": f"ev-{action}-{target.get('digest', '')}",
        "timestamp": "2026-12-06T02:50:00.123456789Z",
        "action": action,
        "target": {"mediaType": "application/vnd.oci.image.manifest.v1+json", "size": 500,
                   "digest": "sha256:aa", "repository": "tenants/acme/tools", **target},
        "actor": {"name": "k-acme-1"},
        "request": {"addr": "127.0.0.1"},
    }  # fmt: skip


def test_pushes_and_deletions_are_kept_with_their_tenant_and_actor() -> None:
    body = {
        "events": [
            _event("push", tag="1"),
            _event("push", digest="sha256:bb", repository="dsec/busybox", size=7),
            _event("delete", digest="sha256:cc"),
        ]
    }
    kept, dropped = read_envelope(body)
    assert dropped == 0
    assert [(e.action, e.tenant, e.repository, e.tag, e.digest, e.size) for e in kept] == [
        ("push", "acme", "tenants/acme/tools", "1", "sha256:aa", 500),
        ("push", None, "dsec/busybox", None, "sha256:bb", 7),
        ("delete", "acme", "tenants/acme/tools", None, "sha256:cc", 500),
    ]
    assert {e.actor_key for e in kept} == {"k-acme-1"}
    assert {e.job for e in kept} == {None}  # a tenant's own push: no job


def test_a_snapshot_push_is_billed_to_the_job_its_ticket_names() -> None:
    event = _event("push", tag="1") | {"actor": {"name": "ticket:node0:rl-run-7"}}
    [kept], _ = read_envelope({"events": [event]})
    assert kept.job == "rl-run-7" and kept.tenant == "acme"


def test_pulls_are_not_kept_and_malformed_events_are_counted_not_half_read() -> None:
    body = {
        "events": [
            _event("pull"),
            _event("mount"),
            {"id": "x", "action": "push"},  # no target, no time
            _event("push", size=-1),
            "not an event",
        ]
    }
    kept, dropped = read_envelope(body)
    assert kept == [] and dropped == 3
    assert read_envelope({"nothing": 1}) == ([], 1)
    assert read_envelope([1, 2]) == ([], 1)


def test_a_manifest_push_keeps_the_blobs_it_references_and_nothing_else_does() -> None:
    layers = [{"mediaType": "x", "digest": "sha256:c1", "size": 9}, {"digest": "sha256:l1",
              "size": 1_000_000, "urls": ["ignored"]}]  # fmt: skip
    body = {
        "events": [
            _event("push", tag="1", references=layers),
            _event(
                "push", digest="sha256:l1", size=1_000_000, mediaType="application/octet-stream"
            ),
            _event("delete", digest="sha256:aa"),
        ]
    }
    manifest, blob, deletion = read_envelope(body)[0]
    assert manifest.refs == [{"digest": "sha256:c1", "size": 9},
                             {"digest": "sha256:l1", "size": 1_000_000}]  # fmt: skip
    assert blob.refs is None and deletion.refs is None
    # a reference without a digest is malformed: the event is dropped, never half-kept
    broken = _event("push", tag="2", references=[{"size": 3}])
    assert read_envelope({"events": [broken]}) == ([], 1)

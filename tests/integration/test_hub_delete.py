"""A tenant deletes its own images from the hub: nobody else may, the deletion is in the
audit trail, creates of the name are refused after it, and what only it held leaves
the tenant's quota and its bill (the attacks are performed, not described)."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from typer.testing import CliRunner

from app import credentials
from app.cli.main import cli
from app.config import Settings
from app.errors import ConfigError, SandboxRejectedError
from app.images import store as image_store
from app.sdk.images import Images
from tests.conftest import forget_tenant, tenant_client, wait_for
from tests.integration.test_hub import _audit, _granted, _tls, _token
from tests.integration.test_images import _rootfs

pytestmark = pytest.mark.integration

runner = CliRunner()


def _storage(db: Any, tenant: str) -> tuple[int, float]:
    """What ``image_storage`` bills the tenant's own pushes: bytes held, GB-hours."""
    with db() as conn:
        row = conn.execute(
            text("SELECT bytes, gb_hours FROM image_storage WHERE tenant = :t AND job = ''"),
            {"t": tenant},
        ).one_or_none()
    return (int(row.bytes), float(row.gb_hours)) if row is not None else (0, 0.0)


def _manifest_recorded(db: Any, tenant: str, tag: str) -> Any:
    return wait_for(
        lambda: [r for r in _audit(db, tenant) if r.tag == tag and r.action == "push"],
        20,
        "the push's manifest in the audit trail",
    )


def test_an_owner_deletes_its_image_and_it_leaves_its_bill_and_its_creates(
    stack: Settings, db: Any, tmp_path: Path
) -> None:
    tenant = f"hubd{uuid.uuid4().hex[:6]}"
    rootfs = tmp_path / "rootfs.tar"
    rootfs.write_bytes(_rootfs(f"first {tenant}"))
    try:
        with tenant_client(stack, tenant, "hub") as client:
            # Given a tenant's image, a sandbox running it, and what it holds billed
            image = client.images.push("tools", rootfs, tag="1")
            _manifest_recorded(db, tenant, "1")
            [listed] = client.images.list()["images"]
            assert listed["name"] == image and listed["size"] > 1_000_000
            held, _ = _storage(db, tenant)
            assert held > 1_000_000
            assert client.images.list()["held_bytes"] == held
            sandbox = client.create(image=image)

            # When its owner deletes it
            [digest] = client.images.delete("tools", tag="1")
            assert digest == listed["digest"]

            # Then the deletion is in the audit trail, by the owner's key
            deletions = wait_for(
                lambda: [r for r in _audit(db, tenant) if r.action == "delete"], 20, "the audit"
            )
            assert [(r.actor_key, r.digest) for r in deletions] == [
                (client.credential.key_id, digest)
            ]
            # and it holds nothing any more: not in its list, its quota or its bill,
            # whose GB-hours stop growing
            assert client.images.list() | {"quota_mb": None} == {
                "images": [], "held_bytes": 0, "quota_mb": None, "quota_images": None,
            }  # fmt: skip
            billed = _storage(db, tenant)
            time.sleep(1.0)
            assert _storage(db, tenant) == billed and billed[0] == 0 and billed[1] > 0
            # and the sandbox that ran it keeps running
            assert sandbox.exec("cat /etc/marker").text == f"first {tenant}"
            sandbox.close()

            # and a create of the name is refused, saying why (within the schedulers'
            # few seconds)
            def refused() -> str | None:
                try:
                    client.create(image=image).close()
                except SandboxRejectedError as exc:
                    return str(exc) if "deleted from the hub" in str(exc) else None
                return None

            assert wait_for(refused, 20, "creates of the deleted image refused")
            # and a second deletion finds nothing
            with pytest.raises(ConfigError, match="holds no such image"):
                client.images.delete("tools", tag="1")

            # When it pushes the name again, with other content, that is what it means
            rootfs.write_bytes(_rootfs(f"second {tenant}"))
            assert client.images.push("tools", rootfs, tag="1") == image
            wait_for(lambda: len(_manifest_recorded(db, tenant, "1")) == 2, 20, "the new push")

            def runs_second() -> bool:
                try:
                    with client.create(image=image) as again:
                        return bool(again.exec("cat /etc/marker").text == f"second {tenant}")
                except SandboxRejectedError:
                    return False

            assert wait_for(runs_second, 30, "the name pushed again to start sandboxes")
            assert _storage(db, tenant)[0] > 1_000_000
    finally:
        forget_tenant(stack, tenant)
        _leave_store(stack, f"tenants/{tenant}/tools:1")


def _leave_store(settings: Settings, image: str) -> None:
    """Take a pulled image out of the node's store again (a later test's disk budget
    counts every pulled image)."""
    wait_for(lambda: not image_store.image_users(image, settings), 30, "its sandboxes to go")
    image_store.remove_image(image, settings)


def _raw_delete(settings: Settings, repository: str, digest: str, token: str) -> int:
    request = urllib.request.Request(
        f"https://{settings.hub}/v2/{repository}/manifests/{digest}",
        method="DELETE",
        headers={"Authorization": f"Bearer {token}"},
    )
    try:
        with urllib.request.urlopen(request, context=_tls(settings), timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_nobody_but_the_owner_deletes_a_tenants_image(
    stack: Settings, db: Any, tmp_path: Path
) -> None:
    owner, rival = f"hubo{uuid.uuid4().hex[:6]}", f"hubr{uuid.uuid4().hex[:6]}"
    rootfs = tmp_path / "rootfs.tar"
    rootfs.write_bytes(_rootfs(owner))
    try:
        with (
            tenant_client(stack, owner, "hub") as client,
            tenant_client(stack, rival, "hub") as other,
        ):
            client.images.push("tools", rootfs, tag="1")
            [manifest] = _manifest_recorded(db, owner, "1")
            repository = f"tenants/{owner}/tools"
            scope = f"repository:{repository}:pull,push,delete"
            node = credentials.load(credentials.node_file(stack, stack.node_id))
            # A rival tenant's and a node's tokens for the owner's repository carry no
            # delete (the node's pulls, the rival's nothing)
            assert _granted(_token(stack, other.credential, scope)) == []
            assert _granted(_token(stack, node, scope)) == ["pull"]
            # and with them the registry refuses the deletion
            for who in (other.credential, node):
                _, body = _token(stack, who, scope)
                assert _raw_delete(stack, repository, manifest.digest, body["token"]) in (401, 403)
            # and the rival's SDK only ever reaches its own namespace
            with pytest.raises(ConfigError, match="holds no such image"):
                other.images.delete("tools", tag="1")
            # and the rival's list shows none of the owner's images
            assert other.images.list()["images"] == []
            # The owner's image is still there, never deleted
            assert [i["name"] for i in client.images.list()["images"]] == [f"{repository}:1"]
            assert not [r for r in _audit(db, owner) if r.action == "delete"]
    finally:
        forget_tenant(stack, owner)
        forget_tenant(stack, rival)


def test_deleting_images_brings_a_tenant_back_under_its_megabytes_quota(
    stack: Settings, db: Any, tmp_path: Path
) -> None:
    tenant = f"hubx{uuid.uuid4().hex[:6]}"
    rootfs = tmp_path / "rootfs.tar"
    rootfs.write_bytes(_rootfs(tenant))  # a gzip'd busybox layer: over 1 MB
    try:
        with tenant_client(stack, tenant, "hub") as client:
            quota = runner.invoke(cli, ["tenant", "quota", tenant, "--image-mb", "1"])
            assert quota.exit_code == 0, quota.output
            client.images.push("tools", rootfs, tag="1")
            _manifest_recorded(db, tenant, "1")
            scope = f"repository:tenants/{tenant}/tools:pull,push,delete"
            # Over its quota: no push, but it may still delete
            wait_for(
                lambda: _granted(_token(stack, client.credential, scope)) == ["pull", "delete"],
                15,
                "the quota to hold",
            )
            # When it deletes its image (through the CLI, as a tenant would)
            done = runner.invoke(cli, ["image", "delete", "tools:1", "--tenant", tenant])
            assert done.exit_code == 0, done.output
            # Then it may push again, at once
            wait_for(
                lambda: "push" in _granted(_token(stack, client.credential, scope)),
                15,
                "room under the quota again",
            )
            Images(stack, client.credential).push("tools", rootfs, tag="2")
            held = runner.invoke(cli, ["image", "held", "--json", "--tenant", tenant])
            assert held.exit_code == 0, held.output
            assert f"tenants/{tenant}/tools:2" in held.output and '"quota_mb": 1' in held.output
    finally:
        forget_tenant(stack, tenant)


def test_the_hubs_garbage_collection_frees_what_deleted_images_held_and_no_more(
    stack: Settings, db: Any, tmp_path: Path
) -> None:
    tenant = f"hubg{uuid.uuid4().hex[:6]}"
    blobs = stack.state_dir / "hub" / "storage" / "docker" / "registry" / "v2" / "blobs"

    def on_disk(digest: str) -> bool:
        hexa = digest.removeprefix("sha256:")
        return (blobs / "sha256" / hexa[:2] / hexa / "data").exists()

    try:
        with tenant_client(stack, tenant, "hub") as client:
            # Given two images of a tenant, each with a layer of its own
            layers = {}
            for name in ("gone", "kept"):
                rootfs = tmp_path / f"{name}.tar"
                rootfs.write_bytes(_rootfs(f"{name} {tenant}"))
                client.images.push(name, rootfs, tag="1")
                with db() as conn:
                    refs = wait_for(
                        lambda n=name: conn.execute(
                            text("SELECT refs FROM hub_events WHERE repository = :r AND tag = '1'"),
                            {"r": f"tenants/{tenant}/{n}"},
                        ).scalar(),
                        20,
                        "the manifest's references",
                    )
                layers[name] = max(refs, key=lambda r: r["size"])["digest"]
                assert on_disk(layers[name])
            # When one is deleted, its layer is still on the hub's disk
            client.images.delete("gone", tag="1")
            assert on_disk(layers["gone"])
            # Then the operator's garbage collection frees it, and only it
            done = runner.invoke(cli, ["image", "gc"])
            assert done.exit_code == 0, done.output
            assert "freed" in done.output
            assert not on_disk(layers["gone"])
            assert on_disk(layers["kept"])
            # and the hub serves again at once: the kept image starts a sandbox
            with client.create(image=f"tenants/{tenant}/kept:1") as sandbox:
                assert sandbox.exec("cat /etc/marker").text == f"kept {tenant}"
    finally:
        forget_tenant(stack, tenant)
        _leave_store(stack, f"tenants/{tenant}/kept:1")


def test_an_operator_deletes_a_tenants_image_and_its_repository_is_free_again(
    stack: Settings, db: Any, tmp_path: Path
) -> None:
    tenant = f"hubp{uuid.uuid4().hex[:6]}"
    rootfs = tmp_path / "rootfs.tar"
    rootfs.write_bytes(_rootfs(tenant))
    operator = credentials.for_client(stack, "operator")
    try:
        with tenant_client(stack, tenant, "hub") as client:
            # Given a tenant allowed one image repository, which it holds
            quota = runner.invoke(cli, ["tenant", "quota", tenant, "--images", "1"])
            assert quota.exit_code == 0, quota.output
            client.images.push("tools", rootfs, tag="1")
            _manifest_recorded(db, tenant, "1")
            other = f"repository:tenants/{tenant}/other:pull,push"
            wait_for(
                lambda: _granted(_token(stack, client.credential, other)) == ["pull"],
                15,
                "the repositories quota to hold",
            )
            # When an operator deletes it by its whole name (an abusive image, say)
            done = runner.invoke(
                cli, ["image", "delete", f"tenants/{tenant}/tools:1", "--tenant", "operator"]
            )
            assert done.exit_code == 0, done.output
            # Then the audit trail names the operator's key, the tenant holds nothing,
            deletions = wait_for(
                lambda: [r for r in _audit(db, tenant) if r.action == "delete"], 20, "the audit"
            )
            assert {r.actor_key for r in deletions} == {operator.key_id}
            assert client.images.list()["images"] == []
            # and its one repository is free again: a new one takes a push
            wait_for(
                lambda: "push" in _granted(_token(stack, client.credential, other)),
                15,
                "the repository freed",
            )
            assert client.images.push("other", rootfs, tag="1") == f"tenants/{tenant}/other:1"
    finally:
        forget_tenant(stack, tenant)

"""The image hub: an operator pushes, a node that lacks an image pulls it for a create,
and nobody else reads or writes (the attacks are performed, not described).

Each image made here has a unique ``dsec-test/hub-...`` name and leaves the store
again; the hub keeps what was pushed (its storage is the stack's).
"""

from __future__ import annotations

import base64
import json
import ssl
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from typer.testing import CliRunner

from app import credentials
from app.cli.main import cli
from app.config import Settings
from app.db.engine import transaction
from app.domain.hub_access import hub_password
from app.errors import ConfigError, SandboxFailedError, SandboxRejectedError
from app.images import store as image_store
from app.metrics import sample, scrape
from app.sdk.images import PushError
from tests.conftest import ensure_tenant, forget_tenant, logged, tenant_client, wait_for
from tests.integration.test_images import _rootfs
from workers.errors import NodeError
from workers.host.hub_client import HubClient
from workers.host.layer_store import image_exists, list_images, store_podman

pytestmark = pytest.mark.integration

runner = CliRunner()
PULLS = "dsec_node_image_pull_seconds_count"


@pytest.fixture
def name(stack: Settings) -> Iterator[str]:
    image = f"dsec-test/hub-{uuid.uuid4().hex[:8]}:1"
    yield image
    image_store.remove_image(image, stack)


def _pulls(settings: Settings) -> float:
    url = (
        f"http://{settings.metrics_host}:{settings.node_metrics_port_of(settings.node_id)}/metrics"
    )
    return sample(scrape(url), PULLS) or 0.0


def _tls(settings: Settings) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(settings.ca_dir / "ca.pem"))


def _get(settings: Settings, url: str, login: tuple[str, str] | None = None) -> Any:
    """(status, parsed JSON body) of a GET, errors included."""
    request = urllib.request.Request(url)
    if login is not None:
        raw = base64.b64encode(f"{login[0]}:{login[1]}".encode()).decode()
        request.add_header("Authorization", f"Basic {raw}")
    try:
        with urllib.request.urlopen(request, context=_tls(settings), timeout=10) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, None


def _token(settings: Settings, cred: Any, scope: str) -> Any:
    url = f"https://{settings.hub.rpartition(':')[0]}:{settings.hub_auth_port}/token"
    login = (cred.key_id, hub_password(cred.secret)) if cred is not None else None
    return _get(settings, f"{url}?service=dsec-hub&scope={scope}", login)


def _granted(status_body: Any) -> list[str]:
    status, body = status_body
    assert status == 200, status
    import jwt

    claims = jwt.decode(body["token"], options={"verify_signature": False})
    return [a for item in claims["access"] for a in item["actions"]]


def test_a_node_pulls_an_image_it_lacks_and_the_second_create_is_warm(
    stack: Settings, name: str, client: Any
) -> None:
    # Given an image an operator pushed to the hub, then removed from this host's store
    marker = f"from the hub {name}"
    assert image_store.import_rootfs_tar(name, _rootfs(marker), stack)
    pushed = runner.invoke(cli, ["image", "push", name])
    assert pushed.exit_code == 0, pushed.output
    assert image_store.remove_image(name, stack)
    assert not image_exists(name, stack)
    before = _pulls(stack)

    # When a trainer creates a sandbox of it, the node pulls it, and the sandbox runs it
    with client.create(image=name) as sandbox:
        assert sandbox.exec("cat /etc/marker").text == marker
    assert image_exists(name, stack)
    assert _pulls(stack) == before + 1

    # Then a second create finds it in the store: no second pull
    with client.create(image=name) as sandbox:
        assert sandbox.exec("cat /etc/marker").text == marker
    assert _pulls(stack) == before + 1
    wait_for(lambda: not image_store.image_users(name, stack), 20, "the sandboxes to go")


def test_an_image_the_hub_lacks_fails_image_not_found(stack: Settings, client: Any) -> None:
    with pytest.raises(SandboxFailedError) as info:
        client.create(image=f"dsec-test/hub-missing-{uuid.uuid4().hex[:8]}:1")
    assert info.value.reason == "image_not_found"
    assert "could not be pulled from the hub" in str(info.value)


def test_a_node_and_a_tenant_cannot_write_to_the_hub(stack: Settings, name: str) -> None:
    # Given an image in the store, and a node's and a tenant's credentials
    assert image_store.import_rootfs_tar(name, _rootfs("forged"), stack)
    node = credentials.load(credentials.node_file(stack, stack.node_id))
    tenant = credentials.for_client(stack)
    for who in (node, tenant):
        # When either pushes it, the hub refuses (the token grants no push)
        with pytest.raises(NodeError, match=r"push of .* to the hub failed"):
            HubClient(stack, who).push(name)
    # and the node's token for a repository allows pulling, nothing else
    assert _granted(_token(stack, node, "repository:dsec/busybox:pull,push,delete")) == ["pull"]
    # and a tenant's pulls the platform's images (its own may start FROM them), no more
    assert _granted(_token(stack, tenant, "repository:dsec/busybox:pull,push")) == ["pull"]


def test_no_login_no_image(stack: Settings) -> None:
    # Given the base image in the hub
    assert runner.invoke(cli, ["image", "push", stack.default_image]).exit_code == 0
    # When a client without a login asks for a token, or for the manifest straight away
    assert _token(stack, None, "repository:dsec/busybox:pull")[0] == 401
    manifest = f"https://{stack.hub}/v2/dsec/busybox/manifests/latest"
    assert _get(stack, manifest)[0] == 401
    # or logs in with a made-up key, or a real key id and a wrong password
    node = credentials.load(credentials.node_file(stack, stack.node_id))
    url = f"https://{stack.hub.rpartition(':')[0]}:{stack.hub_auth_port}/token?service=dsec-hub"
    assert _get(stack, url, ("k-made-up", "x" * 64))[0] == 401
    assert _get(stack, url, (node.key_id, hub_password(b"guess" * 8)))[0] == 401
    # and nobody, operators included, lists the hub's repositories
    operator = credentials.for_client(stack, "operator")
    assert _granted(_token(stack, operator, "registry:catalog:*")) == []


def test_a_revoked_credential_gets_no_token_within_seconds(stack: Settings) -> None:
    # Given an operator who can push
    who = f"hubop{uuid.uuid4().hex[:6]}"
    cred = ensure_tenant(stack, who, "operator")
    scope = "repository:dsec/busybox:pull,push"
    assert _granted(_token(stack, cred, scope)) == ["pull", "push"]
    # When its key is revoked, the token service refuses it within its keyring's refresh
    forget_tenant(stack, who)
    wait_for(lambda: _token(stack, cred, scope)[0] == 401, 15, "the revoked key to be refused")


def test_the_budget_evicts_the_least_recently_used_pulled_image_no_sandbox_runs(
    stack: Settings, client: Any
) -> None:
    # Given three images in the hub, none in the store
    names = [f"dsec-test/hub-{uuid.uuid4().hex[:8]}:{i}" for i in range(3)]
    for name in names:
        assert image_store.import_rootfs_tar(name, _rootfs(name), stack)
        assert runner.invoke(cli, ["image", "push", name]).exit_code == 0
        assert image_store.remove_image(name, stack)
    try:
        # and a node whose budget holds what the store has now plus two of them
        each = 2.2e6  # a busybox root filesystem with a marker
        now = sum(i.size for i in list_images(stack))
        budget_mb = int((now + 2 * each) / 2**20) + 1
        budget = stack.model_copy(update={"node_image_budget_mb": budget_mb})
        node = HubClient(budget, credentials.load(credentials.node_file(stack, stack.node_id)))
        first, second, third = names
        node.pull(first)
        node.pull(second)
        # When a sandbox runs the oldest, and a third image is pulled
        with client.create(image=first) as sandbox:
            assert sandbox.exec("cat /etc/marker").text == first
            node.pull(third)
            # Then the least recently used image no container uses went, and only it
            assert not image_exists(second, stack)
            assert image_exists(first, stack) and image_exists(third, stack)
        # and an evicted image comes back on the next create that names it
        with client.create(image=second) as sandbox:
            assert sandbox.exec("cat /etc/marker").text == second
    finally:
        wait_for(lambda: not any(image_store.image_users(n, stack) for n in names), 20, "idle")
        for name in names:
            if image_exists(name, stack):
                image_store.remove_image(name, stack)


def test_a_tenant_pushes_its_own_image_and_only_its_sandboxes_start_from_it(
    stack: Settings, tmp_path: Path
) -> None:
    owner, other = (f"hubt{uuid.uuid4().hex[:6]}" for _ in range(2))
    rootfs = tmp_path / "rootfs.tar"
    rootfs.write_bytes(_rootfs(f"{owner}'s own"))
    image = ""
    try:
        with (
            tenant_client(stack, owner, "hub") as mine,
            tenant_client(stack, other, "hub") as theirs,
        ):
            # Given a tenant that pushed a root filesystem with nothing but the SDK
            image = mine.images.push("tools", rootfs, tag="1")
            assert image == f"tenants/{owner}/tools:1"
            # When it creates a sandbox of it, the node pulls it and the sandbox runs it
            with mine.create(image=image) as sandbox:
                assert sandbox.exec("cat /etc/marker").text == f"{owner}'s own"
            # Then another tenant's create of it is refused before any node pulls it
            with pytest.raises(SandboxRejectedError) as refused:
                theirs.create(image=image)
            assert refused.value.reason == "forbidden"
            # and its login reads nothing of it, nor writes there or to the platform's
            mine_cred, theirs_cred = mine.credential, theirs.credential
            repo = f"tenants/{owner}/tools"
            assert _granted(_token(stack, theirs_cred, f"repository:{repo}:pull,push")) == []
            platform = "repository:dsec/busybox:pull,push,delete"
            assert _granted(_token(stack, theirs_cred, platform)) == ["pull"]
            assert _granted(_token(stack, mine_cred, f"repository:{repo}:pull,push,delete")) == [
                "pull",
                "push",
                "delete",  # its own: it may take it away (test_hub_delete.py)
            ]
    finally:
        if image:
            wait_for(lambda: not image_store.image_users(image, stack), 20, "the sandbox to go")
            image_store.remove_image(image, stack)
        forget_tenant(stack, owner)
        forget_tenant(stack, other)


def _audit(db: Any, tenant: str) -> list[Any]:
    with db() as conn:
        query = (
            "SELECT action, actor_key, repository, tag, digest, size FROM hub_events"
            " WHERE tenant = :t ORDER BY at"
        )
        return list(conn.execute(text(query), {"t": tenant}))


def test_every_push_is_in_the_audit_trail_and_the_images_quota_holds(
    stack: Settings, db: Any, tmp_path: Path
) -> None:
    tenant = f"hubq{uuid.uuid4().hex[:6]}"
    rootfs = tmp_path / "rootfs.tar"
    rootfs.write_bytes(_rootfs(tenant))
    try:
        with tenant_client(stack, tenant, "hub") as client:
            # When a tenant pushes an image, the push is in SQL: who, what, digest, size
            client.images.push("first", rootfs, tag="1")
            manifests = wait_for(
                lambda: [r for r in _audit(db, tenant) if r.tag == "1"], 20, "the audit row"
            )
            [row] = manifests
            assert row.action == "push" and row.actor_key == client.credential.key_id
            assert row.repository == f"tenants/{tenant}/first"
            assert row.digest.startswith("sha256:") and row.size > 0
            blobs = [r for r in _audit(db, tenant) if r.tag is None]
            assert sum(r.size for r in blobs) > 1_000_000  # the layer, gzip'd busybox
            # And when an operator allows it one image repository (within 5 s)
            quota = runner.invoke(cli, ["tenant", "quota", tenant, "--images", "1"])
            assert quota.exit_code == 0, quota.output
            second = f"repository:tenants/{tenant}/second:pull,push"
            wait_for(
                lambda: _granted(_token(stack, client.credential, second)) == ["pull"],
                15,
                "the quota to hold",
            )
            # Then a second repository is refused, and the first still takes tags
            with pytest.raises(PushError, match=r"401|403"):
                client.images.push("second", rootfs, tag="1")
            assert client.images.push("first", rootfs, tag="2") == f"tenants/{tenant}/first:2"
    finally:
        forget_tenant(stack, tenant)


def test_the_megabytes_quota_stops_pushes_once_a_tenant_holds_that_much(
    stack: Settings, db: Any, tmp_path: Path
) -> None:
    from app.sdk.images import Images

    tenant = f"hubm{uuid.uuid4().hex[:6]}"
    rootfs = tmp_path / "rootfs.tar"
    rootfs.write_bytes(_rootfs(tenant))  # a gzip'd busybox layer: over 1 MB
    try:
        with tenant_client(stack, tenant, "hub") as client:
            # Given an operator's limit of 1 MB on what its images hold in the hub
            quota = runner.invoke(cli, ["tenant", "quota", tenant, "--image-mb", "1"])
            assert quota.exit_code == 0, quota.output
            shown = runner.invoke(cli, ["tenant", "quota", tenant, "--show", "--json"])
            assert {"resource": "image_mb", "limit": 1, "from": "tenant"} in json.loads(
                shown.output
            )
            # When its first push takes it past the line (checked as a push begins)
            client.images.push("first", rootfs, tag="1")
            wait_for(lambda: sum(r.size for r in _audit(db, tenant) if r.tag is None), 20,
                     "the push's blobs in the audit trail")  # fmt: skip
            # Then no repository of its own, old or new, takes another push
            for repository in ("first", "second"):
                scope = f"repository:tenants/{tenant}/{repository}:pull,push"
                wait_for(
                    lambda s=scope: _granted(_token(stack, client.credential, s)) == ["pull"],
                    15,
                    "the quota to hold",
                )
            # (a client's token taken before holds for its few minutes: a new client)
            with pytest.raises(PushError, match=r"401|403"):
                Images(stack, client.credential).push("first", rootfs, tag="2")
            # and when the operator lifts it, pushes go again
            runner.invoke(cli, ["tenant", "quota", tenant, "--image-mb", "none"])
            scope = f"repository:tenants/{tenant}/first:pull,push"
            wait_for(
                lambda: "push" in _granted(_token(stack, client.credential, scope)),
                15,
                "the quota lifted",
            )
    finally:
        forget_tenant(stack, tenant)


def test_a_snapshot_keeps_the_workspace_and_a_group_forks_from_it(
    stack: Settings, client: Any
) -> None:
    name, tag = f"snap{uuid.uuid4().hex[:6]}", "1"
    image = f"tenants/{client.tenant}/{name}:{tag}"
    try:
        with client.create() as sandbox:
            # Given a sandbox that wrote files, a directory and a link to /
            made = sandbox.exec(
                "echo hi > /workspace/a && mkdir /workspace/d && echo x > /workspace/d/b"
                " && ln -s / /workspace/up && chmod 4755 /workspace/a"
            )
            assert made.ok, made
            # When it is snapshotted, the answer names the tenant's image
            assert sandbox.snapshot(name, tag=tag) == image
            # and the sandbox goes on running (its processes were only stopped)
            assert sandbox.exec("cat /workspace/a").text == "hi\n"
        # Then a group forked from the snapshot holds the files, the link as a link
        with client.create_group(2, image=image) as group:
            for fork in group:
                seen = fork.exec("cat /workspace/a /workspace/d/b; readlink /workspace/up")
                assert seen.text == "hi\nx\n/\n", seen
                # and nothing came back setuid
                assert fork.exec("stat -c %a /workspace/a").text == "755\n"
        # and the hub's audit trail has the push, by the node's ticket, for the tenant's
        # job, whose storage is billed in SQL
        pushed = _audit_where(stack, f"tenants/{client.tenant}/{name}")
        assert pushed[0].actor_key == f"ticket:{stack.node_id}:{client.job_id}"
        assert pushed[0].job == client.job_id
        with transaction(stack.database_url) as conn:
            billed = conn.execute(
                text("SELECT bytes, gb_hours FROM image_storage WHERE tenant = :t AND job = :j"),
                {"t": client.tenant, "j": client.job_id},
            ).one()
        assert billed.bytes > 0 and billed.gb_hours >= 0
    finally:
        wait_for(lambda: not image_store.image_users(image, stack), 20, "the forks to go")
        if image_exists(image, stack):
            image_store.remove_image(image, stack)


def _audit_where(settings: Settings, repository: str) -> list[Any]:
    def rows() -> list[Any]:
        with transaction(settings.database_url) as conn:
            query = "SELECT actor_key, job, tag FROM hub_events WHERE repository = :r"
            return list(conn.execute(text(query), {"r": repository}))

    return list(wait_for(lambda: [r for r in rows() if r.tag], 20, "the audit rows"))


def test_a_snapshot_ticket_pushes_to_its_one_repository_and_cannot_be_forged(
    stack: Settings,
) -> None:
    from app.control.keyring import read_master
    from app.domain.hub_access import ticket_password, ticket_user
    from app.domain.proof import derive_ticket_key

    key = derive_ticket_key(read_master(stack))
    url = f"https://{stack.hub.rpartition(':')[0]}:{stack.hub_auth_port}/token?service=dsec-hub"

    def granted(user: str, password: str, repository: str) -> Any:
        status, body = _get(
            stack, f"{url}&scope=repository:{repository}:pull,push", (user, password)
        )
        return _granted((status, body)) if status == 200 else status

    # Given a ticket the scheduler would hand node0 for one repository
    user = ticket_user(stack.node_id, "tenants/acme/snap", int(time.time()) + 60)
    assert granted(user, ticket_password(key, user), "tenants/acme/snap") == ["pull", "push"]
    # Then it pushes nowhere else, and a guessed, altered or expired one gets nothing
    assert granted(user, ticket_password(key, user), "tenants/acme/other") == ["pull"]
    assert granted(user, ticket_password(b"guess" * 8, user), "tenants/acme/snap") == 401
    other = ticket_user(stack.node_id, "tenants/victim/snap", int(time.time()) + 60)
    assert granted(other, ticket_password(key, user), "tenants/victim/snap") == 401
    stale = ticket_user(stack.node_id, "tenants/acme/snap", int(time.time()) - 1)
    assert granted(stale, ticket_password(key, stale), "tenants/acme/snap") == 401


def test_an_owner_shares_an_image_with_a_named_tenant_and_takes_it_back(
    stack: Settings, tmp_path: Path
) -> None:
    owner, reader, third = (f"hubs{uuid.uuid4().hex[:6]}" for _ in range(3))
    rootfs = tmp_path / "rootfs.tar"
    rootfs.write_bytes(_rootfs("shared"))
    image = ""

    def starts(client: Any) -> bool:
        try:
            with client.create(image=image) as sandbox:
                return bool(sandbox.exec("cat /etc/marker").text == "shared")
        except SandboxRejectedError:
            return False

    try:
        with (
            tenant_client(stack, owner, "hub") as mine,
            tenant_client(stack, reader, "hub") as theirs,
            tenant_client(stack, third, "hub") as others,
        ):
            image = mine.images.push("shared", rootfs, tag="1")
            repo = f"repository:tenants/{owner}/shared:pull"
            assert not starts(theirs)
            # When its owner shares it with one tenant, that tenant's sandboxes start from it
            mine.images.share("shared", [reader])
            wait_for(lambda: starts(theirs), 20, "the share to hold")
            assert _granted(_token(stack, theirs.credential, repo)) == ["pull"]
            # and nobody else's: a third tenant, or the reader sharing it further
            assert _granted(_token(stack, others.credential, repo)) == []
            assert not starts(others)
            with pytest.raises(PushError, match="403"):
                _post_share(stack, theirs.credential, f"tenants/{owner}/shared", [third])
            with pytest.raises(PushError, match="only an operator makes an image public"):
                mine.images.share("shared", ["*"])
            # When it takes the share back, the reader's creates are refused again
            mine.images.share("shared", [reader], remove=True)
            wait_for(lambda: not starts(theirs), 20, "the unshare to hold")
            # and an operator may make it public
            done = runner.invoke(cli, ["image", "share", f"tenants/{owner}/shared", "--public"])
            assert done.exit_code == 0, done.output
            wait_for(lambda: _granted(_token(stack, others.credential, repo)) == ["pull"], 20, "")
    finally:
        if image:
            wait_for(lambda: not image_store.image_users(image, stack), 20, "the sandboxes to go")
            image_store.remove_image(image, stack)
        for name in (owner, reader, third):
            forget_tenant(stack, name)


def _post_share(settings: Settings, cred: Any, repository: str, readers: list[str]) -> None:
    """A share asked for with ``cred``'s login, whoever owns ``repository``."""
    url = f"https://{settings.hub.rpartition(':')[0]}:{settings.hub_auth_port}/share"
    login = base64.b64encode(f"{cred.key_id}:{hub_password(cred.secret)}".encode()).decode()
    body = json.dumps({"repository": repository, "readers": readers}).encode()
    request = urllib.request.Request(url, data=body, method="POST")
    request.add_header("Authorization", f"Basic {login}")
    try:
        urllib.request.urlopen(request, context=_tls(settings), timeout=10).close()
    except urllib.error.HTTPError as exc:
        raise PushError(f"refused {exc.code}") from exc


def test_a_paused_sandbox_gives_its_room_back_and_resumes_with_its_files(
    stack: Settings,
) -> None:
    from app.sdk.aio import AsyncClient
    from tests.integration.test_sdk_async import scenario

    async def body(client: AsyncClient) -> tuple[str, str, str]:
        box = await client.create()
        await box.exec("echo kept > /workspace/f")
        # When it is paused, it is kept as an image and destroyed
        image = await box.pause()
        # Then a sandbox resumed from that image has its files
        back = await client.create(image=image)
        try:
            seen = (await back.exec("cat /workspace/f")).text
        finally:
            await back.close()
        return image, box.sync.id, seen

    image, paused_id, seen = scenario(stack, body)
    try:
        assert image == f"tenants/tests/paused-{paused_id}:paused"
        assert seen == "kept\n"

        # and the paused sandbox ended, its room given back
        def state() -> Any:
            with transaction(stack.database_url) as conn:
                query = "SELECT state FROM sandboxes WHERE sandbox_id = :s"
                return conn.execute(text(query), {"s": paused_id}).scalar()

        wait_for(lambda: state() == "stopped", 20, "the paused sandbox to stop")
    finally:
        wait_for(lambda: not image_store.image_users(image, stack), 20, "the sandbox to go")
        image_store.remove_image(image, stack)


@pytest.mark.parametrize("archive", ["docker-archive", "oci-archive"])
def test_a_tenant_pushes_an_image_archive_and_a_name_that_exists_is_refused(
    stack: Settings, name: str, tmp_path: Path, archive: str
) -> None:
    from app.errors import ConfigError

    # Given an image saved as an archive (as `podman save` or `docker save` write them)
    assert image_store.import_rootfs_tar(name, _rootfs(archive), stack)
    saved = tmp_path / "image.tar"
    store_podman(stack, "save", "--format", archive, "--output", str(saved), name)
    tenant = f"huba{uuid.uuid4().hex[:6]}"
    image = ""
    try:
        with tenant_client(stack, tenant, "hub") as client:
            # When the tenant pushes it, its own layers come along and a sandbox runs it
            image = client.images.push("saved", saved, tag="1")
            with client.create(image=image) as sandbox:
                assert sandbox.exec("cat /etc/marker").text == archive
            # Then pushing that name:tag again is refused, and changes nothing
            with pytest.raises(ConfigError, match="exists: images are never overwritten"):
                client.images.push("saved", tmp_path / "image.tar", tag="1")
            # and what is no tar at all is refused before anything is sent
            junk = tmp_path / "junk.tar"
            junk.write_bytes(b"not a tar" * 100)
            with pytest.raises(ConfigError, match="not a tar archive"):
                client.images.push("junk", junk)
    finally:
        if image:
            wait_for(lambda: not image_store.image_users(image, stack), 20, "the sandbox to go")
            image_store.remove_image(image, stack)
        forget_tenant(stack, tenant)


def test_a_tenant_image_with_device_files_is_refused_with_a_reason(
    stack: Settings, tmp_path: Path
) -> None:
    import io
    import tarfile

    # Given a root filesystem that carries a device file (the host's memory, 1:1)
    rootfs = tmp_path / "rootfs.tar"
    with (
        tarfile.open(fileobj=io.BytesIO(_rootfs("devices")), mode="r") as src,
        tarfile.open(rootfs, "w") as dst,
    ):
        for member in src:
            dst.addfile(member, src.extractfile(member) if member.isfile() else None)
        device = tarfile.TarInfo("etc/mem")
        device.type, device.devmajor, device.devminor = tarfile.CHRTYPE, 1, 1
        dst.addfile(device)
    tenant = f"hubd{uuid.uuid4().hex[:6]}"
    try:
        with tenant_client(stack, tenant, "hub") as client:
            image = client.images.push("devices", rootfs, tag="1")
            # When a sandbox of it is asked for, the node refuses it, saying why
            with pytest.raises(SandboxFailedError) as failed:
                client.create(image=image)
            assert failed.value.reason == "refused"
            assert "holds device files (/etc/mem)" in str(failed.value)
            # Then nothing of it is left in the store
            assert not image_exists(image, stack)
    finally:
        forget_tenant(stack, tenant)


def test_an_image_over_the_size_limit_is_refused_by_the_sdk_and_by_the_node(
    stack: Settings, tmp_path: Path
) -> None:
    from app.sdk.images import Images

    rootfs = tmp_path / "rootfs.tar"
    rootfs.write_bytes(_rootfs("oversize"))  # busybox: ~2 MB unpacked
    small = stack.model_copy(update={"image_max_mb": 1})
    tenant = f"hubs{uuid.uuid4().hex[:6]}"
    try:
        with tenant_client(stack, tenant, "hub") as client:
            # The SDK refuses before sending a byte
            with pytest.raises(ConfigError, match="over the limit of 1 MB"):
                Images(small, client.credential).push("big", rootfs, tag="1")
            # (so big:1 does not exist: this push of it is not refused as one that does)
            # A tenant that skips the SDK's check (here: a larger limit of its own) is
            # stopped by the node: the image is removed after its pull, the create
            # refused with the reason
            image = client.images.push("big", rootfs, tag="1")
            node_key = credentials.load(credentials.node_file(stack, stack.node_id))
            with pytest.raises(NodeError, match="over the limit of 1 MB: refused"):
                HubClient(small, node_key).pull(image, refresh=False)
            assert not image_exists(image, stack)
    finally:
        forget_tenant(stack, tenant)


def test_a_tenant_builds_a_containerfile_from_the_hubs_images_only(
    stack: Settings, tmp_path: Path
) -> None:
    assert runner.invoke(cli, ["image", "push", stack.default_image]).exit_code == 0
    (tmp_path / "hello.txt").write_text("copied\n")
    containerfile = tmp_path / "Containerfile"
    containerfile.write_text(
        f"FROM {stack.default_image} AS base\n"
        "FROM base\n"
        "COPY hello.txt /opt/hello.txt\n"
        # RUN steps have no network: only loopback
        'RUN echo "built $(ls /sys/class/net)" > /opt/built.txt\n'
    )
    owner, builder = f"hubo{uuid.uuid4().hex[:6]}", f"hubb{uuid.uuid4().hex[:6]}"
    try:
        with (
            tenant_client(stack, owner, "hub") as other,
            tenant_client(stack, builder, "hub") as client,
        ):
            # When a tenant builds FROM the platform's image, its image runs what it built
            image = client.images.build("built", containerfile, tmp_path, tag="1")
            assert image == f"tenants/{builder}/built:1"
            with client.create(image=image) as box:
                assert box.exec("cat /opt/hello.txt /opt/built.txt").text == "copied\nbuilt lo\n"
            # And a FROM it may not use is refused before a step runs, naming it
            rootfs = tmp_path / "rootfs.tar"
            rootfs.write_bytes(_rootfs(owner))
            private = other.images.push("private", rootfs, tag="1")
            for base, why in (
                (private, "may not use it"),
                (f"tenants/{builder}/missing:1", "no such image"),
                ("docker.io/library/alpine:3", "not an image of the hub"),
            ):
                containerfile.write_text(f"FROM {base}\nRUN touch /ran\n")
                with pytest.raises(ConfigError, match=why):
                    client.images.build("refused", containerfile, tmp_path, tag="1")
            # and nothing was pushed for it: the name is free (here through the CLI)
            containerfile.write_text(f"FROM {image}\n")
            made = runner.invoke(cli, ["image", "publish", "refused", str(tmp_path),
                                       "--tag", "1", "--tenant", builder])  # fmt: skip
            assert made.exit_code == 0, made.output
            assert made.stdout.strip() == f"tenants/{builder}/refused:1"
    finally:
        forget_tenant(stack, owner)
        forget_tenant(stack, builder)
        image_store.remove_image(f"tenants/{builder}/built:1", stack)


def test_a_tag_moved_behind_the_sdks_back_changes_nothing_a_sandbox_runs(
    stack: Settings, db: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.sdk.images import Images

    first, moved = tmp_path / "first.tar", tmp_path / "moved.tar"
    first.write_bytes(_rootfs("first-content"))
    moved.write_bytes(_rootfs("moved-content"))
    tenant = f"hubt{uuid.uuid4().hex[:6]}"
    try:
        with tenant_client(stack, tenant, "hub") as client:
            image = client.images.push("tools", first, tag="1")
            wait_for(lambda: [r for r in _audit(db, tenant) if r.tag == "1"], 20, "the push")
            # When the tenant moves the tag, skipping the SDK's refusal of a name that
            # exists (the registry itself lets an owner do it)
            sneaky = Images(stack, client.credential)
            monkeypatch.setattr(sneaky, "_has", lambda repository, tag: False)
            sneaky.push("tools", moved, tag="1")
            pushes = wait_for(
                lambda: len(rows := [r for r in _audit(db, tenant) if r.tag == "1"]) == 2 and rows,
                20,
                "the second push",
            )
            assert pushes[0].digest != pushes[1].digest
            # and this node's store holds the moved content under the name (pulled by
            # its tag, as a node that never checked would have)
            node_key = credentials.load(credentials.node_file(stack, stack.node_id))
            hub = HubClient(stack, node_key)
            hub.pull(image)
            # (a warm container of the name would not be handed over: the node sees that
            # the name does not hold its first push)
            assert not hub.holds(image, pushes[0].digest)
            assert hub.holds(image, pushes[1].digest)
            # Then a sandbox of it runs what the name was first pushed as
            with client.create(image=image) as box:
                assert box.exec("cat /etc/marker").text == "first-content"
            # and its start in the log names the content it ran (the projector may still
            # be gathering the sandbox's last events into one transaction)
            started = wait_for(
                lambda: logged(db, box.id, "image_digest", "SandboxStarted"), 20, "the start"
            )
            assert started == [pushes[0].digest]
            described = runner.invoke(cli, ["describe", box.id, "--json"])
            assert json.loads(described.output)["image_digest"] == pushes[0].digest
            assert hub.holds(image, pushes[0].digest)  # the name holds its first push again
    finally:
        forget_tenant(stack, tenant)
        image_store.remove_image(f"tenants/{tenant}/tools:1", stack)


def test_a_node_prefetches_the_units_popular_images_and_its_budget_keeps_them(
    stack: Settings, tmp_path: Path
) -> None:
    import threading

    popular, other = (f"dsec-test/hub-{uuid.uuid4().hex[:8]}:1" for _ in range(2))
    for name in (popular, other):
        assert image_store.import_rootfs_tar(name, _rootfs(name), stack)
        assert runner.invoke(cli, ["image", "push", name]).exit_code == 0
        assert image_store.remove_image(name, stack)
    tenant = f"hubp{uuid.uuid4().hex[:6]}"
    late = f"tenants/{tenant}/late:1"  # pushed by a tenant later: never in the store first
    # A budget with room for what the store holds now and one more image
    now = sum(i.size for i in list_images(stack))
    settings = stack.model_copy(
        update={"node_image_budget_mb": int((now + 2.2e6) / 2**20) + 1,
                "node_prefetch": [popular, late]}
    )  # fmt: skip
    node = HubClient(settings, credentials.load(credentials.node_file(stack, stack.node_id)))
    try:
        # When a node starts with two popular images, one of them not in the hub yet
        fetching = threading.Thread(target=node.prefetch, args=([popular, late], 0.5))
        fetching.start()
        wait_for(lambda: image_exists(popular, stack), 30, "the popular image")
        assert fetching.is_alive()  # still trying for the one the hub lacks
        # Then the one pushed later arrives by itself
        rootfs = tmp_path / "late.tar"
        rootfs.write_bytes(_rootfs(late))
        with tenant_client(stack, tenant, "hub") as client:
            assert client.images.push("late", rootfs, tag="1") == late
        fetching.join(timeout=30)
        assert not fetching.is_alive() and image_exists(late, stack)
        # and a pull past the budget evicts neither, though used least recently
        node.pull(other)
        assert image_exists(popular, stack) and image_exists(late, stack)
    finally:
        forget_tenant(stack, tenant)
        for name in (popular, late, other):
            if image_exists(name, stack):
                image_store.remove_image(name, stack)

"""``dsec image``: the shared layer store, driven as an operator would (the CLI, as root).

Every image made here has a unique ``dsec-test/...`` name and is removed again; the
shared ``dsec/busybox:latest`` is only read. The Debian image is kept once built (it is
the one trainers use), and its debootstrap root filesystem is cached in
``state_dir/cache``: the first run on a machine takes about a minute more.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from app.cli.main import cli
from app.config import Settings
from app.images import store as image_store
from app.images.build import tarball_kind
from app.images.debian import DEBIAN_IMAGE, build_debian_image, debian_mirror
from tests.conftest import wait_for
from workers.host import layer_store

pytestmark = pytest.mark.integration

runner = CliRunner()


def dsec(*args: str, input: bytes | None = None) -> Result:
    return runner.invoke(cli, list(args), input=input)


@pytest.fixture(scope="module")
def store(settings: Settings) -> Settings:
    if os.geteuid() != 0 or shutil.which("podman") is None:
        pytest.fail("needs root and podman (apt-get install podman runc uidmap)", pytrace=False)
    image_store.import_busybox_image(settings=settings)
    return settings


@pytest.fixture
def name(store: Settings) -> Iterator[str]:
    """A unique image name, removed from the store after the test whatever happened."""
    image = f"dsec-test/img-{uuid.uuid4().hex[:8]}:1"
    yield image
    image_store.remove_image(image, store)


def _rootfs(marker: str) -> bytes:
    """The busybox root filesystem plus /etc/marker (so the layer is this test's own)."""
    base = image_store.busybox_rootfs_tar()
    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(base)) as src, tarfile.open(fileobj=out, mode="w") as dst:
        for member in src:
            dst.addfile(member, src.extractfile(member) if member.isfile() else None)
        info = tarfile.TarInfo("etc/marker")
        info.size = len(marker.encode())
        dst.addfile(info, io.BytesIO(marker.encode()))
    return out.getvalue()


def _listed(name: str) -> list[dict[str, Any]]:
    result = dsec("image", "ls", "--json")
    assert result.exit_code == 0, result.output
    rows: list[dict[str, Any]] = json.loads(result.output)
    return [r for r in rows if r["name"] == name]


def test_import_ls_rm(store: Settings, name: str, tmp_path: Path) -> None:
    # Given a rootfs tarball of a tiny busybox system
    tarball = tmp_path / "rootfs.tar"
    tarball.write_bytes(_rootfs(name))
    assert tarball_kind(tarball) == "rootfs"

    # When it is imported, it is listed with id, size and creation time
    result = dsec("image", "import", name, str(tarball), "--change", 'CMD ["/bin/sh"]')
    assert result.exit_code == 0, result.output
    assert "imported" in result.output and "rootfs" in result.output
    [row] = _listed(name)
    assert len(row["id"]) == 64 and row["size"] > 1_000_000 and row["created"]

    # A second import under the same name is refused: images never change under sandboxes
    again = dsec("image", "import", name, str(tarball))
    assert again.exit_code == 1 and "already in the store" in again.output

    # When it is removed, it is gone; removing it again says so
    assert dsec("image", "rm", name).exit_code == 0
    assert _listed(name) == []
    missing = dsec("image", "rm", name)
    assert missing.exit_code == 1 and "not in the store" in missing.output


def test_import_from_stdin_and_from_a_podman_save_archive(
    store: Settings, name: str, tmp_path: Path
) -> None:
    # Given an image imported from stdin
    assert dsec("image", "import", name, "-", input=_rootfs(name)).exit_code == 0
    # When `podman save` writes it to an archive and that archive is imported again
    archive = tmp_path / "saved.tar"
    layer_store.store_podman(store, "save", "--output", str(archive), name)
    assert tarball_kind(archive) == "archive"
    copy = name.replace(":1", ":copy")
    try:
        result = dsec("image", "import", copy, str(archive))
        assert result.exit_code == 0, result.output
        assert "archive" in result.output
        # Then both names point at the same image: one set of layers
        [original], [loaded] = _listed(name), _listed(copy)
        assert loaded["id"] == original["id"]
    finally:
        image_store.remove_image(copy, store)


def test_built_image_runs_in_a_sandbox(
    store: Settings, name: str, tmp_path: Path, client: Any
) -> None:
    # Given a Containerfile FROM the store's busybox that adds a file and an ARG
    (tmp_path / "hello.txt").write_text("hello from the layer store\n")
    (tmp_path / "Containerfile").write_text(
        "FROM dsec/busybox:latest\n"
        "ARG GREETING=hi\n"
        "COPY hello.txt /etc/dsec-hello\n"
        'RUN echo "$GREETING" > /etc/greeting\n'
    )
    # When it is built into the store
    built = dsec(
        "image", "build", name, "-f", str(tmp_path / "Containerfile"), "--build-arg", "GREETING=yo"
    )
    assert built.exit_code == 0, built.output
    assert _listed(name)

    # Then a sandbox created from it through the SDK reads the file
    with client.create(image=name) as sandbox:
        result = sandbox.exec("cat /etc/dsec-hello /etc/greeting")
        assert result.ok, result
        assert result.text == "hello from the layer store\nyo\n"
        # and the image cannot be removed while the sandbox runs it
        refused = dsec("image", "rm", name)
        assert refused.exit_code == 1 and "runs in 1 sandbox" in refused.output
    wait_for(lambda: not image_store.image_users(name, store), 20, "the sandbox to go")
    assert dsec("image", "rm", name).exit_code == 0


def test_build_never_pulls(store: Settings, name: str, tmp_path: Path) -> None:
    # Given a Containerfile FROM an image that exists only in a registry
    (tmp_path / "Containerfile").write_text("FROM docker.io/library/alpine:3\n")
    # When it is built, it fails at once, naming the rule, and nothing is stored
    result = dsec("image", "build", name, "-f", str(tmp_path / "Containerfile"))
    assert result.exit_code == 1
    assert "FROM must name an image in the store" in result.output
    assert _listed(name) == []


def test_debian_mirror_comes_from_apt_sources(tmp_path: Path) -> None:
    (tmp_path / "a.sources").write_text(
        "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n"
        "Components: main\n\n"
        "Types: deb deb-src\nURIs: http://mirror.example/debian\n"
        "Suites: bookworm bookworm-updates\nComponents: main contrib\n"
    )
    (tmp_path / "b.list").write_text(
        "deb [arch=amd64 signed-by=/k.gpg] http://other/debian trixie main\n"
    )
    assert debian_mirror("bookworm", [tmp_path]) == "http://mirror.example/debian"
    assert debian_mirror("trixie", [tmp_path]) == "http://other/debian"


@pytest.mark.slow
def test_debian_image_runs_python_and_git(store: Settings, client: Any) -> None:
    # Given the Debian image (built with debootstrap once, then kept in the store)
    build_debian_image(store)
    again = build_debian_image(store)
    assert again.skipped, "an image in the store is not built again"

    # When a sandbox runs it, python3 and git from Debian's packages work
    with client.create(image=DEBIAN_IMAGE) as sandbox:
        py = sandbox.exec("python3 -c 'print(1+1)'")
        assert py.ok and py.text == "2\n", py
        git = sandbox.exec("git --version")
        assert git.ok and git.text.startswith("git version 2."), git
        # git commits in the writable workspace with the image's system-wide identity
        repo = sandbox.exec(
            "git init -q r && cd r && echo x > f && git add f && git commit -qm first"
            " && git log --format=%an"
        )
        assert repo.ok and repo.text == "dsec sandbox\n", repo

"""Partial and lazy pulls: zstd:chunked and eStargz against whole-layer gzip pulls.

    .venv/bin/python bench/partial_pull.py [--sizes 100,1000] [--changed-pct 1]
                                           [--repeat 1] [--stargz-store PATH] [--keep]

Needs root, Podman (4.3.1 on Debian 12 here), runc, util-linux's unshare, Debian's
``docker-registry`` (Distribution 2.8) and ``busybox-static``; it does not use the
stack (no ``dsec up`` needed) and touches neither /etc/containers nor any other store.

Everything lives under /tmp/pp-*: its own registry (``docker-registry serve`` on
127.0.0.1:5999, plain HTTP, filesystem storage in /tmp/pp-registry, access log with
response sizes), a source store (/tmp/pp-src) where the images are built and pushed from,
and one fresh store per pull scenario (/tmp/pp-dst-*), each with its own storage.conf
passed through ``CONTAINERS_STORAGE_CONF`` and its own containers.conf
(``CONTAINERS_CONF``: runc, cgroupfs, no network). Each podman command runs in a private
mount namespace with an empty directory bound over /var/lib/containers, so that root's
blob-info cache (/var/lib/containers/cache) is neither read nor written: a push never
reuses a blob of another compression and every pull starts as on a host that never saw
the image. Stores are named by storage.conf alone: Podman 4.3.1 drops storage.conf's
driver options (additionallayerstores, additionalimagestores) when ``--root`` is given.

Per size S (MB) it builds, FROM a busybox base, image A (a layer of S MB in files of
512 KiB of random data) and image B (the same files with ``--changed-pct`` of them
rewritten, built as a new layer), pushes both with gzip and with zstd:chunked, and
measures with wall time, CPU time of the podman client (its rusage) and of the registry
(/proc/PID/stat), and the bytes the registry sent (GET lines of its access log):
- gzip: cold ``podman pull`` of A into an empty store (the "raw podman pull"), the first
  command (``podman run --rm A busybox md5sum /data/f00000``: 512 KiB read), a command
  that reads every file of the layer (``cat /data/*``), then B pulled into the store
  that holds A and the first command in B;
- zstd:chunked with ``enable_partial_images``: the same steps;
- zstd:chunked with partial pulls off (whole-layer zstd) for the cold pull;
- with ``--stargz-store PATH`` (a stargz-store binary from containerd's
  stargz-snapshotter, v0.15.x: later ones key layers by TOC digest, which Podman 4.3.1
  does not pass), lazy pulls: the images pushed as eStargz (by a small Go program built
  here with go-containerregistry and stargz-snapshotter's estargz module, from the Go
  module proxy), a store whose storage.conf names stargz-store's FUSE mount as an
  additional layer store, and the same steps; stargz-store runs with prefetch and
  background fetch off, so the bytes are what the pull and each command read.
Time to first command = cold pull + first run. Random data does not compress, so bytes
fetched are close to the layer size for both formats; the registry serves from the page
cache over loopback, so fetch time is near zero and the pulls measure the client's work.
The last line is ``RESULT partial_pull ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REG_ADDR = "127.0.0.1:5999"
TMP = Path("/tmp")
REG_DIR = TMP / "pp-registry"
CONF_DIR = TMP / "pp-conf"
DATA_DIR = TMP / "pp-data"
NS_DIR = TMP / "pp-varlib"  # bound over /var/lib/containers inside each podman's namespace
FILE_KIB = 512
BASE_IMAGE = "localhost/pp-base:1"
FIRST_CMD = ["/bin/busybox", "md5sum", "/data/f00000"]
READ_ALL_CMD = ["/bin/busybox", "sh", "-c", "cat /data/* >/dev/null"]
ACCESS_RE = re.compile(r'"(GET|HEAD|PUT|POST|PATCH) (\S+) HTTP/[\d.]+" (\d{3}) (\d+)')
CLK_TCK = os.sysconf("SC_CLK_TCK")
ESGZ_DIR = TMP / "pp-esgz"

ESGZ_PUSH_GO = """\
// esgz-push REF LAYER.tar...: push an OCI image of eStargz layers, one per tar file.
package main

import (
\t"compress/gzip"
\t"fmt"
\t"io"
\t"log"
\t"os"

\t"github.com/containerd/stargz-snapshotter/estargz"
\t"github.com/google/go-containerregistry/pkg/name"
\tv1 "github.com/google/go-containerregistry/pkg/v1"
\t"github.com/google/go-containerregistry/pkg/v1/empty"
\t"github.com/google/go-containerregistry/pkg/v1/mutate"
\t"github.com/google/go-containerregistry/pkg/v1/remote"
\t"github.com/google/go-containerregistry/pkg/v1/tarball"
\t"github.com/google/go-containerregistry/pkg/v1/types"
)

func layer(path string) (v1.Layer, map[string]string, error) {
\tf, err := os.Open(path)
\tif err != nil {
\t\treturn nil, nil, err
\t}
\tdefer f.Close()
\tst, err := f.Stat()
\tif err != nil {
\t\treturn nil, nil, err
\t}
\tblob, err := estargz.Build(io.NewSectionReader(f, 0, st.Size()),
\t\testargz.WithCompressionLevel(gzip.DefaultCompression))
\tif err != nil {
\t\treturn nil, nil, err
\t}
\tdefer blob.Close()
\tout := path + ".esgz"
\tw, err := os.Create(out)
\tif err != nil {
\t\treturn nil, nil, err
\t}
\tif _, err := io.Copy(w, blob); err != nil {
\t\treturn nil, nil, err
\t}
\tif err := w.Close(); err != nil {
\t\treturn nil, nil, err
\t}
\tsize, err := blob.UncompressedSize()
\tif err != nil {
\t\treturn nil, nil, err
\t}
\tl, err := tarball.LayerFromFile(out, tarball.WithMediaType(types.OCILayer))
\tann := map[string]string{
\t\t"containerd.io/snapshot/stargz/toc.digest": blob.TOCDigest().String(),
\t\t"io.containers.estargz.uncompressed-size":  fmt.Sprint(size),
\t}
\treturn l, ann, err
}

func main() {
\tref, err := name.ParseReference(os.Args[1], name.Insecure)
\tif err != nil {
\t\tlog.Fatal(err)
\t}
\timg := mutate.ConfigMediaType(mutate.MediaType(empty.Image, types.OCIManifestSchema1),
\t\ttypes.OCIConfigJSON)
\tfor _, path := range os.Args[2:] {
\t\tl, ann, err := layer(path)
\t\tif err != nil {
\t\t\tlog.Fatal(err)
\t\t}
\t\tadd := mutate.Addendum{Layer: l, Annotations: ann, MediaType: types.OCILayer}
\t\tif img, err = mutate.Append(img, add); err != nil {
\t\t\tlog.Fatal(err)
\t\t}
\t}
\tcf, err := img.ConfigFile()
\tif err != nil {
\t\tlog.Fatal(err)
\t}
\tcf = cf.DeepCopy()
\tcf.OS, cf.Architecture = "linux", "amd64"
\tif img, err = mutate.ConfigFile(img, cf); err != nil {
\t\tlog.Fatal(err)
\t}
\tif err := remote.Write(ref, img); err != nil {
\t\tlog.Fatal(err)
\t}
}
"""
ESGZ_MODULES = [
    "github.com/google/go-containerregistry@v0.22.1",
    "github.com/containerd/stargz-snapshotter/estargz@v0.18.2",
]
STARGZ_CONF = "noprefetch = true\nno_background_fetch = true\n"

CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]
netns = "none"

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""

REGISTRY_CONF = f"""\
version: 0.1
log:
  level: warn
  formatter: text
storage:
  filesystem:
    rootdirectory: {REG_DIR}
  delete:
    enabled: true
  redirect:
    disable: true
http:
  addr: {REG_ADDR}
  secret: partial-pull-bench
"""


@dataclass
class Measure:
    """One podman command: wall and CPU seconds, and what the registry did meanwhile."""

    wall_s: float
    cpu_s: float
    reg_cpu_s: float
    fetched: int
    requests: int
    ranged: int
    fuse_cpu_s: float = 0.0


@dataclass
class Scenario:
    """One store and how its images were pulled."""

    name: str
    short: str
    steps: dict[str, Measure] = field(default_factory=dict)


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a running process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class Registry:
    """Distribution 2.8 (Debian's docker-registry) on 127.0.0.1:5999 with an access log."""

    def __init__(self) -> None:
        self.log_path = TMP / "pp-registry.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        REG_DIR.mkdir(parents=True, exist_ok=True)
        conf = CONF_DIR / "registry.yml"
        conf.write_text(REGISTRY_CONF)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            ["/usr/bin/docker-registry", "serve", str(conf)], stdout=log, stderr=log
        )
        for _ in range(100):
            probe = subprocess.run(["curl", "-sf", f"http://{REG_ADDR}/v2/"], capture_output=True)
            if probe.returncode == 0:
                return
            time.sleep(0.1)
        raise RuntimeError(f"registry did not start: {self.log_path.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    def cpu_s(self) -> float:
        assert self.proc is not None
        return proc_cpu_s(self.proc.pid)

    def log_offset(self) -> int:
        return self.log_path.stat().st_size

    def traffic_since(self, offset: int) -> tuple[int, int, int]:
        """Bytes sent for GETs since offset, GET requests, and partial (206) answers."""
        with self.log_path.open("rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        sent = requests = ranged = 0
        for found in ACCESS_RE.finditer(text):
            method, _path, status, size = found.groups()
            if method != "GET":
                continue
            requests += 1
            sent += int(size)
            ranged += status == "206"
        return sent, requests, ranged


class Store:
    """A private root Podman store with its own storage.conf."""

    def __init__(self, name: str, partial: bool = False, layer_store: Path | None = None) -> None:
        self.name = name
        self.root = TMP / f"pp-{name}"
        self.runroot = TMP / f"pp-{name}-run"
        self.tmpdir = TMP / f"pp-{name}-tmp"
        self.conf = CONF_DIR / f"storage-{name}.conf"
        options = ""
        if partial:
            options += (
                'pull_options = {enable_partial_images = "true", use_hard_links = "false", '
                'ostree_repos = ""}\n'
            )
        if layer_store is not None:
            # ":ref": Podman passes the image reference, stargz-store needs it to fetch.
            options += f'additionallayerstores = ["{layer_store}:ref"]\n'
        self.conf.write_text(
            f'[storage]\ndriver = "overlay"\nrunroot = "{self.runroot}"\n'
            f'graphroot = "{self.root}"\n\n[storage.options]\n{options}'
        )
        self.helper_pid: int | None = None  # a process whose CPU time counts too

    def argv(self, *args: str) -> list[str]:
        # A private mount namespace with an empty dir over /var/lib/containers: root's
        # blob-info cache is neither read (no blob reuse across formats) nor written.
        ns = NS_DIR / self.name
        shutil.rmtree(ns, ignore_errors=True)
        (ns / "cache").mkdir(parents=True)
        script = 'mount --bind "$0" /var/lib/containers && exec podman "$@"'
        # No --root/--runroot: with them Podman 4.3.1 ignores storage.conf's driver
        # options (additionallayerstores); graphroot and runroot come from self.conf.
        podman = ["--tmpdir", str(self.tmpdir), *args]
        unshare = ["unshare", "-m", "--propagation", "private", "--", "sh", "-c", script]
        return [*unshare, str(ns), *podman]

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "CONTAINERS_CONF": str(CONF_DIR / "containers.conf"),
            "CONTAINERS_STORAGE_CONF": str(self.conf),
        }

    def run(self, *args: str, stdin: bytes | None = None) -> str:
        done = subprocess.run(self.argv(*args), env=self.env(), input=stdin, capture_output=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"podman {' '.join(args)} failed ({done.returncode}): "
                f"{done.stderr.decode(errors='replace')[-3000:]}"
            )
        return done.stdout.decode(errors="replace")

    def measured(self, registry: Registry, *args: str) -> Measure:
        offset = registry.log_offset()
        reg_cpu = registry.cpu_s()
        fuse_cpu = proc_cpu_s(self.helper_pid) if self.helper_pid else 0.0
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.monotonic()
        self.run(*args)
        wall = time.monotonic() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        time.sleep(0.2)  # let the registry flush its access log
        fetched, requests, ranged = registry.traffic_since(offset)
        if self.helper_pid:
            fuse_cpu = proc_cpu_s(self.helper_pid) - fuse_cpu
        reg = registry.cpu_s() - reg_cpu
        return Measure(wall, cpu, reg, fetched, requests, ranged, fuse_cpu)

    def reset(self) -> None:
        if self.root.exists():
            try:
                self.run("system", "reset", "-f")
            except RuntimeError as exc:
                print(f"warning: reset of {self.name}: {exc}", file=sys.stderr)
        for path in (self.root, self.runroot, self.tmpdir, NS_DIR / self.name):
            shutil.rmtree(path, ignore_errors=True)


class StargzStore:
    """stargz-store (containerd's stargz-snapshotter): eStargz layers on a FUSE mount."""

    def __init__(self, binary: Path, name: str) -> None:
        self.binary = binary
        self.dir = TMP / f"pp-stargz-{name}"
        self.mountpoint = self.dir / "store"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        conf = CONF_DIR / "stargz-store.toml"
        conf.write_text(STARGZ_CONF)
        self.dir.mkdir(parents=True)
        log = (self.dir / "log").open("ab")
        argv = [str(self.binary), "--root", str(self.dir / "root"), "--config", str(conf)]
        usage = subprocess.run([str(self.binary), "-h"], capture_output=True, text=True)
        if "-addr" in usage.stderr + usage.stdout:  # v0.16+: its socket, else /var/lib/...
            argv += ["--addr", str(self.dir / "store.sock")]
        self.proc = subprocess.Popen([*argv, str(self.mountpoint)], stdout=log, stderr=log)
        for _ in range(100):
            if str(self.mountpoint) in mounts_under_tmp_pp():
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"stargz-store did not mount: {(self.dir / 'log').read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        if str(self.mountpoint) in mounts_under_tmp_pp():  # stargz-store leaves it
            subprocess.run(["umount", str(self.mountpoint)], check=False)
        if str(self.mountpoint) not in mounts_under_tmp_pp():
            shutil.rmtree(self.dir, ignore_errors=True)


def build_esgz_push() -> Path:
    """Build the eStargz pusher (Go modules from the Go module proxy)."""
    ESGZ_DIR.mkdir(parents=True)
    (ESGZ_DIR / "main.go").write_text(ESGZ_PUSH_GO)
    (ESGZ_DIR / "go.mod").write_text("module esgzpush\n\ngo 1.22\n")
    for argv in (["go", "get", *ESGZ_MODULES], ["go", "mod", "tidy"]):
        subprocess.run(argv, cwd=ESGZ_DIR, check=True, capture_output=True)
    subprocess.run(["go", "build", "-o", "esgz-push", "."], cwd=ESGZ_DIR, check=True)
    return ESGZ_DIR / "esgz-push"


def mounts_under_tmp_pp() -> list[str]:
    lines = Path("/proc/self/mountinfo").read_text().splitlines()
    return [ln.split()[4] for ln in lines if ln.split()[4].startswith("/tmp/pp-")]


def make_files(size_mb: int, changed_pct: float) -> tuple[Path, Path]:
    """Build contexts for image A (size_mb of random files) and B (a few rewritten)."""
    count = size_mb * 1024 // FILE_KIB
    ctx_a, ctx_b = DATA_DIR / f"{size_mb}-a", DATA_DIR / f"{size_mb}-b"
    for ctx in (ctx_a, ctx_b):
        shutil.rmtree(ctx, ignore_errors=True)
        (ctx / "data").mkdir(parents=True)
        (ctx / "Containerfile").write_text(f"FROM {BASE_IMAGE}\nCOPY data /data\n")
    changed = max(1, round(count * changed_pct / 100))
    step = count // changed
    for i in range(count):
        blob = os.urandom(FILE_KIB * 1024)
        (ctx_a / "data" / f"f{i:05d}").write_bytes(blob)
        if i % step == step - 1 and i // step < changed:
            blob = os.urandom(FILE_KIB * 1024)
        (ctx_b / "data" / f"f{i:05d}").write_bytes(blob)
    return ctx_a, ctx_b


def make_base(src: Store) -> None:
    """A busybox root filesystem (Debian's busybox-static) imported as one layer."""
    rootfs = DATA_DIR / "base"
    (rootfs / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copy2("/bin/busybox", rootfs / "bin" / "busybox")
    for applet in ("sh", "true", "md5sum", "cat", "ls"):
        link = rootfs / "bin" / applet
        if not link.is_symlink():
            link.symlink_to("busybox")
    tar = subprocess.run(["tar", "-C", str(rootfs), "-c", "."], capture_output=True, check=True)
    (DATA_DIR / "base.tar").write_bytes(tar.stdout)
    src.run("import", "-", BASE_IMAGE, stdin=tar.stdout)


def manifest_layers(repo: str, tag: str) -> list[dict[str, object]]:
    accept = (
        "application/vnd.oci.image.manifest.v1+json,"
        "application/vnd.docker.distribution.manifest.v2+json"
    )
    out = subprocess.run(
        ["curl", "-sf", "-H", f"Accept: {accept}", f"http://{REG_ADDR}/v2/{repo}/manifests/{tag}"],
        capture_output=True,
        check=True,
    )
    layers: list[dict[str, object]] = json.loads(out.stdout)["layers"]
    return layers


def mb(n: float) -> str:
    return f"{n / 1e6:.1f}"


def pull_steps(
    store: Store, registry: Registry, ref_a: str, ref_b: str | None
) -> dict[str, Measure]:
    pull = ("pull", "-q", "--tls-verify=false")
    run = ("run", "--rm", "--pull=never", "--network=none")
    steps = {"cold pull": store.measured(registry, *pull, ref_a)}
    steps["first run"] = store.measured(registry, *run, ref_a, *FIRST_CMD)
    steps["read all"] = store.measured(registry, *run, ref_a, *READ_ALL_CMD)
    if ref_b is not None:
        steps["update pull"] = store.measured(registry, *pull, ref_b)
        steps["update run"] = store.measured(registry, *run, ref_b, *FIRST_CMD)
    return steps


def run_size(
    size_mb: int,
    changed_pct: float,
    repeat: int,
    registry: Registry,
    src: Store,
    stargz: Path | None,
    esgz_push: Path | None,
) -> dict[str, object]:
    print(f"== {size_mb} MB: generating files", flush=True)
    ctx_a, ctx_b = make_files(size_mb, changed_pct)
    img_a, img_b = f"localhost/pp-{size_mb}:a", f"localhost/pp-{size_mb}:b"
    t0 = time.monotonic()
    src.run("build", "--pull=never", "-q", "-t", img_a, str(ctx_a))
    src.run("build", "--pull=never", "-q", "-t", img_b, str(ctx_b))
    print(f"   built A and B in {time.monotonic() - t0:.1f} s", flush=True)
    tars: dict[str, Path] = {}
    if esgz_push is not None:
        for tag, ctx in (("a", ctx_a), ("b", ctx_b)):
            tars[tag] = DATA_DIR / f"{size_mb}-{tag}.tar"
            subprocess.run(["tar", "-C", str(ctx), "-cf", str(tars[tag]), "data"], check=True)
    shutil.rmtree(ctx_a)
    shutil.rmtree(ctx_b)

    pushes: dict[str, Measure] = {}
    image_sizes: dict[str, int] = {}
    for fmt, short in (("gzip", "gz"), ("zstd:chunked", "zc")):
        for tag, img in (("a", img_a), ("b", img_b)):
            dest = f"{REG_ADDR}/pp/{short}-{size_mb}:{tag}"
            push = ("push", "-q", "--tls-verify=false", "--compression-format", fmt, img, dest)
            pushes[f"{short} {tag}"] = src.measured(registry, *push)
            layers = manifest_layers(f"pp/{short}-{size_mb}", tag)
            image_sizes[f"{short} {tag}"] = sum(int(str(layer["size"])) for layer in layers)
            if fmt == "zstd:chunked" and "annotations" not in layers[-1]:
                raise RuntimeError(f"{dest}: no zstd:chunked annotations: {layers[-1]}")
            print(f"   pushed {dest}: {pushes[f'{short} {tag}'].wall_s:.1f} s", flush=True)
    src.run("rmi", img_a, img_b)
    if esgz_push is not None:
        for tag in ("a", "b"):
            dest = f"{REG_ADDR}/pp/es-{size_mb}:{tag}"
            offset, reg_cpu = registry.log_offset(), registry.cpu_s()
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.monotonic()
            argv = [str(esgz_push), dest, str(DATA_DIR / "base.tar"), str(tars[tag])]
            subprocess.run(argv, check=True, capture_output=True)
            wall = time.monotonic() - t0
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            sent = registry.traffic_since(offset)
            reg = registry.cpu_s() - reg_cpu
            pushes[f"es {tag}"] = Measure(wall, cpu, reg, *sent)
            layers = manifest_layers(f"pp/es-{size_mb}", tag)
            image_sizes[f"es {tag}"] = sum(int(str(layer["size"])) for layer in layers)
            for path in (tars[tag], Path(f"{tars[tag]}.esgz")):
                path.unlink()
            print(f"   pushed {dest} (eStargz): {wall:.1f} s", flush=True)

    scenarios: list[Scenario] = []
    plans = [
        ("gzip", "gz", "partial-off", True),
        ("zstd:chunked partial", "zc", "partial-on", True),
        ("zstd:chunked whole", "zc", "partial-off", False),
    ]
    if stargz is not None:
        plans.append(("eStargz lazy", "es", "lazy", True))
    for label, short, mode, with_update in plans:
        runs: list[dict[str, Measure]] = []
        for rep in range(repeat):
            name = f"dst-{short}-{mode}-{size_mb}-{rep}"
            fuse = StargzStore(stargz, name) if mode == "lazy" and stargz else None
            store = Store(
                name, partial=mode == "partial-on", layer_store=fuse.mountpoint if fuse else None
            )
            try:
                if fuse is not None:
                    fuse.start()
                    assert fuse.proc is not None
                    store.helper_pid = fuse.proc.pid
                ref_a = f"{REG_ADDR}/pp/{short}-{size_mb}:a"
                ref_b = f"{REG_ADDR}/pp/{short}-{size_mb}:b" if with_update else None
                steps = pull_steps(store, registry, ref_a, ref_b)
            finally:
                store.reset()
                if fuse is not None:
                    fuse.stop()
            print(f"   {label} #{rep + 1}: cold pull {steps['cold pull'].wall_s:.2f} s", flush=True)
            runs.append(steps)
        scen = Scenario(label, short)
        for step in runs[0]:
            by_wall = sorted((r[step] for r in runs), key=lambda m: m.wall_s)
            scen.steps[step] = by_wall[len(by_wall) // 2]  # the median run of this step
        scenarios.append(scen)
    return {"size_mb": size_mb, "pushes": pushes, "images": image_sizes, "scenarios": scenarios}


PUSH_LABELS = {"gz": "gzip", "zc": "zstd:chunked", "es": "eStargz"}


def print_report(results: list[dict[str, object]], changed_pct: float) -> None:
    hdr = (
        f"{'size':>5} {'format':<21} {'step':<12} {'wall s':>7} {'cpu s':>6} {'reg cpu':>7} "
        f"{'fuse cpu':>8} {'fetched MB':>10} {'% image':>7} {'GETs':>5} {'206':>4}"
    )
    print()
    print(hdr)
    print("-" * len(hdr))
    for res in results:
        size = int(str(res["size_mb"]))
        images: dict[str, int] = res["images"]  # type: ignore[assignment]
        pushes: dict[str, Measure] = res["pushes"]  # type: ignore[assignment]
        scenarios: list[Scenario] = res["scenarios"]  # type: ignore[assignment]
        for key, m in pushes.items():
            short, tag = key.split()
            print(
                f"{size:>5} {PUSH_LABELS[short]:<21} {'push ' + tag:<12} {m.wall_s:>7.2f} "
                f"{m.cpu_s:>6.2f} {m.reg_cpu_s:>7.2f}"
            )
        for scen in scenarios:
            for step, m in scen.steps.items():
                image = images[f"{scen.short} {'b' if step.startswith('update') else 'a'}"]
                print(
                    f"{size:>5} {scen.name:<21} {step:<12} {m.wall_s:>7.2f} {m.cpu_s:>6.2f} "
                    f"{m.reg_cpu_s:>7.2f} {m.fuse_cpu_s:>8.2f} {mb(m.fetched):>10} "
                    f"{100 * m.fetched / image:>7.1f} {m.requests:>5} {m.ranged:>4}"
                )
    print(
        f"\nimage sizes (MB, all layers as pushed); B = A with {changed_pct:g} % of files rewritten"
    )
    for res in results:
        images = res["images"]  # type: ignore[assignment]
        print(f"  {res['size_mb']} MB: " + ", ".join(f"{k} {mb(v)}" for k, v in images.items()))

    parts: list[str] = []
    for res in results:
        size = res["size_mb"]
        by_name = {s.name: s.steps for s in res["scenarios"]}  # type: ignore[attr-defined]
        images = res["images"]  # type: ignore[assignment]
        gz, zc, zw = by_name["gzip"], by_name["zstd:chunked partial"], by_name["zstd:chunked whole"]
        raw = gz["cold pull"].wall_s
        ttfc_zc = zc["cold pull"].wall_s + zc["first run"].wall_s
        parts += [
            f"s{size}_gzip_pull_s={raw:.2f}",
            f"s{size}_gzip_ttfc_s={raw + gz['first run'].wall_s:.2f}",
            f"s{size}_gzip_read_all_s={gz['read all'].wall_s:.2f}",
            f"s{size}_zchunked_ttfc_s={ttfc_zc:.2f}",
            f"s{size}_zchunked_vs_raw={ttfc_zc / raw:.2f}",
            f"s{size}_zchunked_fetched_pct={100 * zc['cold pull'].fetched / images['zc a']:.0f}",
            f"s{size}_zstd_whole_pull_s={zw['cold pull'].wall_s:.2f}",
            f"s{size}_update_gzip_s={gz['update pull'].wall_s:.2f}",
            f"s{size}_update_gzip_mb={mb(gz['update pull'].fetched)}",
            f"s{size}_update_zchunked_s={zc['update pull'].wall_s:.2f}",
            f"s{size}_update_zchunked_mb={mb(zc['update pull'].fetched)}",
        ]
        lazy = by_name.get("eStargz lazy")
        if lazy is not None:
            ttfc = lazy["cold pull"].wall_s + lazy["first run"].wall_s
            fetched = lazy["cold pull"].fetched + lazy["first run"].fetched
            parts += [
                f"s{size}_lazy_ttfc_s={ttfc:.2f}",
                f"s{size}_lazy_read_all_s={lazy['read all'].wall_s:.2f}",
                f"s{size}_lazy_fetched_pct={100 * fetched / images['es a']:.1f}",
            ]
    print("RESULT partial_pull " + " ".join(parts))


def cleanup(registry: Registry, stores: list[Store]) -> None:
    for store in stores:
        store.reset()
    registry.stop()
    left = mounts_under_tmp_pp()
    if left:
        print(f"warning: mounts left under /tmp/pp-*: {left}", file=sys.stderr)
        return
    for path in TMP.glob("pp-*"):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100,1000", help="layer sizes in MB")
    parser.add_argument("--changed-pct", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=1, help="pull scenarios: median of N")
    parser.add_argument("--stargz-store", type=Path, help="stargz-store binary: lazy pulls too")
    parser.add_argument("--keep", action="store_true", help="leave /tmp/pp-* for inspection")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (root Podman with private stores)")
    if not Path("/var/lib/containers").is_dir():
        sys.exit("/var/lib/containers is missing: the blob-info cache could not be hidden")
    if list(TMP.glob("pp-*")):
        sys.exit("/tmp/pp-* exists: a previous run left it; remove it first")
    if args.stargz_store is not None and not shutil.which("go"):
        sys.exit("--stargz-store needs Go to build the eStargz pusher")
    sizes = [int(s) for s in args.sizes.split(",") if s]
    podman_version = subprocess.run(
        ["podman", "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    print(f"{podman_version}; sizes {sizes} MB; {FILE_KIB} KiB files of random data", flush=True)

    CONF_DIR.mkdir(parents=True)
    (CONF_DIR / "containers.conf").write_text(CONTAINERS_CONF)
    registry = Registry()
    src = Store("src")
    try:
        esgz_push = build_esgz_push() if args.stargz_store is not None else None
        registry.start()
        make_base(src)
        results = [
            run_size(s, args.changed_pct, args.repeat, registry, src, args.stargz_store, esgz_push)
            for s in sizes
        ]
        print_report(results, args.changed_pct)
    finally:
        if args.keep:
            registry.stop()
        else:
            cleanup(registry, [src])


if __name__ == "__main__":
    main()

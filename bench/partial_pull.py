"""Partial pulls: zstd:chunked against whole-layer gzip pulls, from a registry of its own.

    .venv/bin/python bench/partial_pull.py [--sizes 100,1000] [--changed-pct 1]
                                           [--repeat 1] [--keep]

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
the image.

Per size S (MB) it builds, FROM a busybox base, image A (a layer of S MB in files of
512 KiB of random data) and image B (the same files with ``--changed-pct`` of them
rewritten, built as a new layer), pushes both with gzip and with zstd:chunked, and
measures with wall time, CPU time of the podman client (its rusage) and of the registry
(/proc/PID/stat), and the bytes the registry sent (GET lines of its access log):
- gzip: cold ``podman pull`` of A into an empty store (the "raw podman pull"), the first
  command (``podman run --rm A busybox md5sum /data/f00000``: 512 KiB read), then B
  pulled into the store that holds A;
- zstd:chunked with ``enable_partial_images``: the same three steps;
- zstd:chunked with partial pulls off (whole-layer zstd) for the cold pull.
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
ACCESS_RE = re.compile(r'"(GET|HEAD|PUT|POST|PATCH) (\S+) HTTP/[\d.]+" (\d{3}) (\d+)')
CLK_TCK = os.sysconf("SC_CLK_TCK")

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


@dataclass
class Scenario:
    """One store and how its images were pulled."""

    name: str
    steps: dict[str, Measure] = field(default_factory=dict)


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
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

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

    def __init__(self, name: str, partial: bool) -> None:
        self.name = name
        self.root = TMP / f"pp-{name}"
        self.runroot = TMP / f"pp-{name}-run"
        self.tmpdir = TMP / f"pp-{name}-tmp"
        self.conf = CONF_DIR / f"storage-{name}.conf"
        pull_options = (
            '\n[storage.options]\npull_options = {enable_partial_images = "true", '
            'use_hard_links = "false", ostree_repos = ""}\n'
            if partial
            else ""
        )
        self.conf.write_text(
            f'[storage]\ndriver = "overlay"\nrunroot = "{self.runroot}"\n'
            f'graphroot = "{self.root}"\n{pull_options}'
        )

    def argv(self, *args: str) -> list[str]:
        # A private mount namespace with an empty dir over /var/lib/containers: root's
        # blob-info cache is neither read (no blob reuse across formats) nor written.
        ns = NS_DIR / self.name
        shutil.rmtree(ns, ignore_errors=True)
        (ns / "cache").mkdir(parents=True)
        script = 'mount --bind "$0" /var/lib/containers && exec podman "$@"'
        podman = ["--root", str(self.root), "--runroot", str(self.runroot)]
        podman += ["--tmpdir", str(self.tmpdir), *args]
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
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.monotonic()
        self.run(*args)
        wall = time.monotonic() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        time.sleep(0.2)  # let the registry flush its access log
        fetched, requests, ranged = registry.traffic_since(offset)
        return Measure(wall, cpu, registry.cpu_s() - reg_cpu, fetched, requests, ranged)

    def reset(self) -> None:
        if self.root.exists():
            try:
                self.run("system", "reset", "-f")
            except RuntimeError as exc:
                print(f"warning: reset of {self.name}: {exc}", file=sys.stderr)
        for path in (self.root, self.runroot, self.tmpdir, NS_DIR / self.name):
            shutil.rmtree(path, ignore_errors=True)


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


def run_size(
    size_mb: int, changed_pct: float, repeat: int, registry: Registry, src: Store
) -> dict[str, object]:
    print(f"== {size_mb} MB: generating files", flush=True)
    ctx_a, ctx_b = make_files(size_mb, changed_pct)
    img_a, img_b = f"localhost/pp-{size_mb}:a", f"localhost/pp-{size_mb}:b"
    t0 = time.monotonic()
    src.run("build", "--pull=never", "-q", "-t", img_a, str(ctx_a))
    src.run("build", "--pull=never", "-q", "-t", img_b, str(ctx_b))
    print(f"   built A and B in {time.monotonic() - t0:.1f} s", flush=True)
    shutil.rmtree(ctx_a)
    shutil.rmtree(ctx_b)

    pushes: dict[str, Measure] = {}
    layer_sizes: dict[str, int] = {}
    for fmt in ("gzip", "zstd:chunked"):
        repo = f"pp/{'gz' if fmt == 'gzip' else 'zc'}-{size_mb}"
        for tag, img in (("a", img_a), ("b", img_b)):
            dest = f"{REG_ADDR}/{repo}:{tag}"
            pushes[f"{fmt} {tag}"] = src.measured(
                registry, "push", "-q", "--tls-verify=false", "--compression-format", fmt, img, dest
            )
            layers = manifest_layers(repo, tag)
            top = layers[-1]
            layer_sizes[f"{fmt} {tag}"] = sum(int(str(layer["size"])) for layer in layers)
            if fmt == "zstd:chunked" and "annotations" not in top:
                raise RuntimeError(f"{dest}: no zstd:chunked annotations: {top}")
            print(f"   pushed {dest}: {pushes[f'{fmt} {tag}'].wall_s:.1f} s", flush=True)
    src.run("rmi", img_a, img_b)

    scenarios: list[Scenario] = []
    plans = [
        ("gzip", "gz", False, True),
        ("zstd:chunked partial", "zc", True, True),
        ("zstd:chunked whole", "zc", False, False),
    ]
    for label, short, partial, with_update in plans:
        runs: list[dict[str, Measure]] = []
        for rep in range(repeat):
            store = Store(f"dst-{short}{'p' if partial else 'w'}-{size_mb}-{rep}", partial)
            ref_a = f"{REG_ADDR}/pp/{short}-{size_mb}:a"
            ref_b = f"{REG_ADDR}/pp/{short}-{size_mb}:b"
            pull = ("pull", "-q", "--tls-verify=false")
            run = ("run", "--rm", "--pull=never", "--network=none")
            steps = {"cold pull": store.measured(registry, *pull, ref_a)}
            steps["first run"] = store.measured(registry, *run, ref_a, *FIRST_CMD)
            if with_update:
                steps["update pull"] = store.measured(registry, *pull, ref_b)
                steps["update run"] = store.measured(registry, *run, ref_b, *FIRST_CMD)
            print(f"   {label} #{rep + 1}: cold pull {steps['cold pull'].wall_s:.2f} s", flush=True)
            store.reset()
            runs.append(steps)
        scen = Scenario(label)
        for step in runs[0]:
            by_wall = sorted((r[step] for r in runs), key=lambda m: m.wall_s)
            scen.steps[step] = by_wall[len(by_wall) // 2]  # the median run of this step
        scenarios.append(scen)
    return {"size_mb": size_mb, "pushes": pushes, "layers": layer_sizes, "scenarios": scenarios}


def print_report(results: list[dict[str, object]], changed_pct: float) -> None:
    hdr = (
        f"{'size':>5} {'format':<21} {'step':<12} {'wall s':>7} {'cpu s':>6} "
        f"{'reg cpu':>7} {'fetched MB':>10} {'% image':>7} {'GETs':>5} {'206':>4}"
    )
    print()
    print(hdr)
    print("-" * len(hdr))
    for res in results:
        size = int(str(res["size_mb"]))
        layers: dict[str, int] = res["layers"]  # type: ignore[assignment]
        pushes: dict[str, Measure] = res["pushes"]  # type: ignore[assignment]
        for key, m in pushes.items():
            fmt, tag = key.split()
            print(
                f"{size:>5} {fmt:<21} {'push ' + tag:<12} {m.wall_s:>7.2f} {m.cpu_s:>6.2f} "
                f"{m.reg_cpu_s:>7.2f} {'':>10} {'':>7} {'':>5} {'':>4}"
            )
        for scen in res["scenarios"]:  # type: ignore[attr-defined]
            fmt_key = "gzip" if scen.name == "gzip" else "zstd:chunked"
            for step, m in scen.steps.items():
                layer = layers[f"{fmt_key} {'b' if step.startswith('update') else 'a'}"]
                pct = f"{100 * m.fetched / layer:.1f}" if "pull" in step else ""
                print(
                    f"{size:>5} {scen.name:<21} {step:<12} {m.wall_s:>7.2f} {m.cpu_s:>6.2f} "
                    f"{m.reg_cpu_s:>7.2f} {mb(m.fetched):>10} {pct:>7} {m.requests:>5} "
                    f"{m.ranged:>4}"
                )
    print(
        f"\nimage sizes (MB, all layers as pushed); B = A with {changed_pct:g} % of files rewritten"
    )
    for res in results:
        layers = res["layers"]  # type: ignore[assignment]
        print(f"  {res['size_mb']} MB: " + ", ".join(f"{k} {mb(v)}" for k, v in layers.items()))

    parts: list[str] = []
    for res in results:
        size = res["size_mb"]
        by_name = {s.name: s.steps for s in res["scenarios"]}  # type: ignore[attr-defined]
        layers = res["layers"]  # type: ignore[assignment]
        gz, zc, zw = by_name["gzip"], by_name["zstd:chunked partial"], by_name["zstd:chunked whole"]
        ttfc_gz = gz["cold pull"].wall_s + gz["first run"].wall_s
        ttfc_zc = zc["cold pull"].wall_s + zc["first run"].wall_s
        parts += [
            f"s{size}_gzip_pull_s={gz['cold pull'].wall_s:.2f}",
            f"s{size}_gzip_ttfc_s={ttfc_gz:.2f}",
            f"s{size}_zchunked_pull_s={zc['cold pull'].wall_s:.2f}",
            f"s{size}_zchunked_ttfc_s={ttfc_zc:.2f}",
            f"s{size}_zstd_whole_pull_s={zw['cold pull'].wall_s:.2f}",
            f"s{size}_zchunked_cold_fetched_pct="
            f"{100 * zc['cold pull'].fetched / layers['zstd:chunked a']:.0f}",
            f"s{size}_update_gzip_s={gz['update pull'].wall_s:.2f}",
            f"s{size}_update_gzip_mb={mb(gz['update pull'].fetched)}",
            f"s{size}_update_zchunked_s={zc['update pull'].wall_s:.2f}",
            f"s{size}_update_zchunked_mb={mb(zc['update pull'].fetched)}",
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
    parser.add_argument("--keep", action="store_true", help="leave /tmp/pp-* for inspection")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (root Podman with private stores)")
    if not Path("/var/lib/containers").is_dir():
        sys.exit("/var/lib/containers is missing: the blob-info cache could not be hidden")
    if list(TMP.glob("pp-*")):
        sys.exit("/tmp/pp-* exists: a previous run left it; remove it first")
    sizes = [int(s) for s in args.sizes.split(",") if s]
    podman_version = subprocess.run(
        ["podman", "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    print(f"{podman_version}; sizes {sizes} MB; {FILE_KIB} KiB files of random data", flush=True)

    CONF_DIR.mkdir(parents=True)
    (CONF_DIR / "containers.conf").write_text(CONTAINERS_CONF)
    registry = Registry()
    src = Store("src", partial=False)
    try:
        registry.start()
        make_base(src)
        results = [run_size(s, args.changed_pct, args.repeat, registry, src) for s in sizes]
        print_report(results, args.changed_pct)
    finally:
        if args.keep:
            registry.stop()
        else:
            cleanup(registry, [src])


if __name__ == "__main__":
    main()

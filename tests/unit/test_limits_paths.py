"""Cgroup layout and limit values (pure), and the limiter on a fake cgroup tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.containers.limits import (
    CgroupLayout,
    CgroupLimiter,
    Hierarchy,
    Limits,
    check_name,
    parse_flat_keyed,
    parse_mountinfo,
)
from workers.containers.podman_api import container_args
from workers.containers.spec import SandboxSpec

# This CI machine: v1 hybrid, cpu and cpuacct in separate hierarchies.
HYBRID = """\
25 24 0:22 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
26 25 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
27 25 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
28 25 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
29 25 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
30 25 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
31 25 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
# A typical systemd v1 host: cpu and cpuacct co-mounted.
COMOUNTED = """\
26 25 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime shared:9 - cgroup cgroup rw,cpu,cpuacct
28 25 0:32 / /sys/fs/cgroup/memory rw,relatime shared:10 - cgroup cgroup rw,memory
29 25 0:36 / /sys/fs/cgroup/pids rw,relatime shared:11 - cgroup cgroup rw,pids
"""
UNIFIED = "25 24 0:22 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
# What a sandbox sees: binds of part of a hierarchy, which are no host hierarchy.
CONTAINER_VIEW = "196 194 0:32 /dsec/n/sb-1 /sys/fs/cgroup/memory ro - cgroup cgroup rw,memory\n"

V1 = Hierarchy(
    1,
    {
        "memory": Path("/cg/memory"),
        "pids": Path("/cg/pids"),
        "cpu": Path("/cg/cpu,cpuacct"),
        "cpuacct": Path("/cg/cpu,cpuacct"),
    },
)
V2 = Hierarchy(2, {"": Path("/cg")})
HALF = Limits.of(memory_mb=64, pids=32, cpus=0.5)


def test_hybrid_host_is_v1_with_each_controller_where_it_is_mounted() -> None:
    h = parse_mountinfo(HYBRID)
    assert h is not None and h.version == 1
    assert h.mounts == {
        "cpu": Path("/sys/fs/cgroup/cpu"),
        "cpuacct": Path("/sys/fs/cgroup/cpuacct"),
        "memory": Path("/sys/fs/cgroup/memory"),
        "pids": Path("/sys/fs/cgroup/pids"),
    }


def test_comounted_controllers_share_a_mount() -> None:
    h = parse_mountinfo(COMOUNTED)
    assert h is not None and h.version == 1
    assert h.mounts["cpu"] == h.mounts["cpuacct"] == Path("/sys/fs/cgroup/cpu,cpuacct")


def test_unified_host_is_v2() -> None:
    assert parse_mountinfo(UNIFIED) == Hierarchy(2, {"": Path("/sys/fs/cgroup")})


@pytest.mark.parametrize("text", ["", CONTAINER_VIEW, COMOUNTED.splitlines()[1] + "\n"])
def test_no_usable_hierarchy(text: str) -> None:
    assert parse_mountinfo(text) is None


def test_v1_dirs_per_controller_under_dsec_node() -> None:
    layout = CgroupLayout(V1, "node0")
    assert layout.dirs("sb-1")["memory"] == Path("/cg/memory/dsec/node0/sb-1")
    assert layout.dirs("sb-1")["cpuacct"] == Path("/cg/cpu,cpuacct/dsec/node0/sb-1")
    # Co-mounted controllers get one directory, made (and attached to) once.
    assert layout.unique_dirs("sb-1") == [
        Path("/cg/memory/dsec/node0/sb-1"),
        Path("/cg/pids/dsec/node0/sb-1"),
        Path("/cg/cpu,cpuacct/dsec/node0/sb-1"),
    ]


def test_v1_writes_memory_before_memsw_and_cfs_quota() -> None:
    writes = CgroupLayout(V1, "n").writes("sb-1", HALF)
    values = {p.name: (v, required) for p, v, required in writes}
    assert values["memory.limit_in_bytes"] == (str(64 << 20), True)
    assert values["memory.memsw.limit_in_bytes"] == (str(64 << 20), False)
    assert values["pids.max"] == ("32", True)
    assert values["cpu.cfs_period_us"] == ("100000", True)
    assert values["cpu.cfs_quota_us"] == ("50000", True)
    assert values["cpu.shares"] == ("512", False)
    names = [p.name for p, _, _ in writes]
    assert names.index("memory.limit_in_bytes") < names.index("memory.memsw.limit_in_bytes")


def test_v2_writes_and_controller_enabling() -> None:
    layout = CgroupLayout(V2, "n")
    values = {p.name: v for p, v, _ in layout.writes("sb-1", HALF)}
    assert values == {
        "memory.max": str(64 << 20),
        "memory.swap.max": "0",
        "pids.max": "32",
        "cpu.max": "50000 100000",
        "cpu.weight": "50",
    }
    assert [p for p, _, _ in layout.enable_writes()] == [
        Path("/cg/cgroup.subtree_control"),
        Path("/cg/dsec/cgroup.subtree_control"),
        Path("/cg/dsec/n/cgroup.subtree_control"),
    ]
    assert {v for _, v, _ in layout.enable_writes()} == {"+memory +pids +cpu"}
    assert CgroupLayout(V1, "n").enable_writes() == []


def test_views_show_only_the_sandbox_own_cgroups() -> None:
    assert CgroupLayout(V2, "n").views("sb-1") == [(Path("/cg/dsec/n/sb-1"), "/sys/fs/cgroup")]
    v1 = CgroupLayout(V1, "n").views("sb-1")
    assert v1[0] == (None, "/sys/fs/cgroup")  # an empty read-only tmpfs hides the host's
    assert (Path("/cg/memory/dsec/n/sb-1"), "/sys/fs/cgroup/memory") in v1
    assert (Path("/cg/cpu,cpuacct/dsec/n/sb-1"), "/sys/fs/cgroup/cpuacct") in v1


def test_oom_and_cpu_sources() -> None:
    assert CgroupLayout(V1, "n").oom_source("s") == (
        Path("/cg/memory/dsec/n/s/memory.oom_control"),
        "oom_kill",
    )
    assert CgroupLayout(V2, "n").oom_source("s") == (
        Path("/cg/dsec/n/s/memory.events"),
        "oom_kill",
    )
    assert CgroupLayout(V1, "n").cpu_source("s") == (
        Path("/cg/cpu,cpuacct/dsec/n/s/cpuacct.usage"),
        None,
        1e-9,
    )
    assert CgroupLayout(V2, "n").cpu_source("s") == (
        Path("/cg/dsec/n/s/cpu.stat"),
        "usage_usec",
        1e-6,
    )


@pytest.mark.parametrize("bad", ["", "..", ".", "a/b", "../x", "-x", "a b", "x" * 200])
def test_names_that_are_no_single_safe_component_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        check_name(bad)
    with pytest.raises(ValueError):
        CgroupLayout(V1, "n").dirs(bad)


def test_limit_values_stay_within_kernel_bounds() -> None:
    tiny = Limits.of(memory_mb=16, pids=8, cpus=0.001)
    assert (tiny.cpu_quota_us, tiny.cpu_shares, tiny.cpu_weight) == (1000, 2, 1)
    assert tiny.cpu_period_us == 1_000_000
    assert Limits.of(16, 8, 200).cpu_weight == 10_000


def test_a_small_cpu_share_comes_over_a_longer_period_in_pieces_a_command_fits() -> None:
    # 0.005 core over 100 ms would be 0.5 ms, under the kernel's 1 ms floor (twice the
    # share), and under the ~2 ms one process start costs: two periods per command.
    small = Limits.of(memory_mb=16, pids=8, cpus=0.005)
    assert (small.cpu_period_us, small.cpu_quota_us) == (1_000_000, 5_000)
    assert small.cpu_quota_us / small.cpu_period_us == pytest.approx(0.005)
    assert (Limits.of(16, 8, 0.05).cpu_period_us, Limits.of(16, 8, 0.05).cpu_quota_us) == (
        200_000,
        10_000,
    )
    # A tenth of a core or more keeps the usual period.
    for cpus in (0.1, 0.5, 2.0):
        limits = Limits.of(16, 8, cpus)
        assert limits.cpu_period_us == 100_000
        assert limits.cpu_quota_us == int(cpus * 100_000)


def test_flat_keyed_files_parse() -> None:
    assert parse_flat_keyed("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n") == {
        "oom_kill_disable": 0,
        "under_oom": 0,
        "oom_kill": 3,
    }
    assert parse_flat_keyed("") == {}


def test_container_args_mount_the_views_read_only() -> None:
    spec = SandboxSpec(sandbox_id="sb-1", image="img")
    mounts = container_args(spec, CgroupLayout(V1, "n").views("sb-1"))["mounts"]
    cg = [m for m in mounts if m["target"].startswith("/sys/fs/cgroup")]
    assert cg[0]["type"] == "tmpfs" and cg[0]["target"] == "/sys/fs/cgroup"
    assert all(m["read_only"] for m in cg)
    assert {m["source"] for m in cg[1:]} >= {"/cg/memory/dsec/n/sb-1", "/cg/pids/dsec/n/sb-1"}
    # Without a limiter Podman's own cgroup mount stays.
    assert not [m for m in container_args(spec)["mounts"] if "cgroup" in m["target"]]


def test_limiter_on_a_fake_tree(tmp_path: Path) -> None:
    # Given a v1 tree where the kernel's files exist only where the kernel would make them
    hierarchy = Hierarchy(1, {c: tmp_path / c for c in ("memory", "pids", "cpu", "cpuacct")})
    limiter = CgroupLimiter(CgroupLayout(hierarchy, "n"))
    # When a sandbox's cgroups are made
    limiter.create("sb-1", HALF)
    mem = tmp_path / "memory/dsec/n/sb-1"
    # Then the required limits are written and the optional file the kernel lacks is not
    assert (mem / "memory.limit_in_bytes").read_text() == str(64 << 20)
    assert not (mem / "memory.memsw.limit_in_bytes").exists()
    assert (tmp_path / "cpu/dsec/n/sb-1/cpu.cfs_quota_us").read_text() == "50000"
    assert limiter.sandbox_ids() == ["sb-1"]
    # And the OOM counter and CPU use read as the kernel writes them
    (mem / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    (tmp_path / "cpuacct/dsec/n/sb-1/cpuacct.usage").write_text("1500000000\n")
    assert limiter.oom_kills("sb-1") == 2
    assert limiter.cpu_usage_s("sb-1") == pytest.approx(1.5)
    assert limiter.oom_kills("sb-unknown") == 0 and limiter.cpu_usage_s("sb-unknown") is None
    # When it is removed (a real cgroup directory has only kernel files: rmdir works)
    for d in limiter.layout.unique_dirs("sb-1"):
        for f in d.iterdir():
            f.unlink()
    assert limiter.remove("sb-1", wait_s=0)
    assert limiter.sandbox_ids() == [] and not mem.exists()
    assert limiter.remove("sb-1", wait_s=0), "removing twice is fine"

"""host_memory on fake /proc and /sys trees: the smallest cgroup headroom up the tree, page cache, fallbacks."""

from __future__ import annotations

import ctypes
import sys
import types

import pytest

from streamwise.runtime.host_memory import HostMemory, HostMemoryError, host_memory

KiB, MiB, GiB = 2**10, 2**20, 2**30
V1_NO_LIMIT = "9223372036854771712"  # what v1 writes for "no limit" (2**63 rounded down to a 4 KiB page)


def put(root, path, text):
    """Write `text` at `root/path`, making the folders on the way."""
    file = root / path
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(text)


def meminfo(root, available=20 * GiB, total=32 * GiB):
    put(root, "proc/meminfo", f"MemTotal:       {total // KiB} kB\nMemFree:         1024 kB\n"
                              f"MemAvailable:   {available // KiB} kB\nBuffers:          0 kB\n")


def v2_level(root, path, limit, current, stat=None, **extra):
    """One v2 cgroup folder under /sys/fs/cgroup: memory.max, memory.current, memory.stat and any other file."""
    folder = f"sys/fs/cgroup/{path}".rstrip("/")
    put(root, f"{folder}/memory.max", f"{limit}\n")
    put(root, f"{folder}/memory.current", f"{current}\n")
    if stat is not None:
        put(root, f"{folder}/memory.stat", "".join(f"{key} {value}\n" for key, value in stat.items()))
    for name, text in extra.items():
        put(root, f"{folder}/{name.replace('_', '.')}", text)


def v2_stat(inactive=0, active=0, dirty=0, writeback=0, mapped=0):
    return {"anon": 123 * MiB, "file": inactive + active, "inactive_file": inactive, "active_file": active,
            "file_mapped": mapped, "file_dirty": dirty, "file_writeback": writeback, "shmem": 0}


def v1_level(root, path, limit, usage, stat=None):
    folder = f"sys/fs/cgroup/memory/{path}".rstrip("/")
    put(root, f"{folder}/memory.limit_in_bytes", f"{limit}\n")
    put(root, f"{folder}/memory.usage_in_bytes", f"{usage}\n")
    if stat is not None:
        put(root, f"{folder}/memory.stat", "".join(f"{key} {value}\n" for key, value in stat.items()))


def v1_stat(inactive=0, active=0, dirty=0, writeback=0, mapped=0):
    own = {"cache": 1, "rss": 2, "inactive_file": 3, "active_file": 4, "dirty": 5}  # this level alone: ignored
    return own | {"total_cache": inactive + active, "total_rss": 0, "total_mapped_file": mapped,
                  "total_dirty": dirty, "total_writeback": writeback, "total_inactive_file": inactive,
                  "total_active_file": active}


V1_CGROUP = "9:name=systemd:/\n5:devices:/docker/abc\n4:memory:/docker/abc\n1:cpu,cpuacct:/docker/abc\n0::/\n"


# --- cgroup v2 -------------------------------------------------------------------------------------------------


def test_v2_nested_the_parents_smaller_limit_wins_with_clean_file_pages_counted(tmp_path):
    meminfo(tmp_path)
    put(tmp_path, "proc/self/cgroup", "0::/user.slice/app.scope\n")
    # The child's own limit is loose (8 GiB, 3 GiB in use) and a soft memory.high of 1 GiB is ignored.
    v2_level(tmp_path, "user.slice/app.scope", 8 * GiB, 3 * GiB, v2_stat(inactive=GiB),
             memory_high=f"{GiB}\n", memory_swap_max="max\n")
    # The parent: 4 GiB, 3.5 GiB in use; 2 GiB of file pages of which 256 MiB dirty, 128 MiB under writeback and
    # 128 MiB mapped: 1.5 GiB reclaimable, so 4 - 3.5 + 1.5 = 2 GiB.
    v2_level(tmp_path, "user.slice", 4 * GiB, 3584 * MiB,
             v2_stat(inactive=GiB, active=GiB, dirty=256 * MiB, writeback=128 * MiB, mapped=128 * MiB))
    put(tmp_path, "sys/fs/cgroup/cgroup.controllers", "cpu memory\n")  # the root: no memory.max at all

    found = host_memory(root=tmp_path)

    assert found == HostMemory(
        available=2 * GiB, total=4 * GiB,
        source="cgroup v2 /sys/fs/cgroup/user.slice: memory.max 4.0 GiB, 3.5 GiB in use of which 1.5 GiB "
               "reclaimable page cache",
    )


def test_v2_the_childs_limit_wins_and_active_file_pages_count_too(tmp_path):
    meminfo(tmp_path)
    put(tmp_path, "proc/self/cgroup", "0::/user.slice/app.scope\n")
    v2_level(tmp_path, "user.slice/app.scope", 2 * GiB, 2 * GiB, v2_stat(inactive=256 * MiB, active=256 * MiB))
    v2_level(tmp_path, "user.slice", 16 * GiB, 2 * GiB, v2_stat())

    found = host_memory(root=tmp_path)

    assert (found.available, found.total) == (512 * MiB, 2 * GiB)
    assert found.source.startswith("cgroup v2 /sys/fs/cgroup/user.slice/app.scope: memory.max 2.0 GiB")


def test_v2_memavailable_wins_when_the_machine_is_shorter_than_the_cgroup(tmp_path):
    meminfo(tmp_path, available=GiB, total=32 * GiB)
    put(tmp_path, "proc/self/cgroup", "0::/app\n")
    v2_level(tmp_path, "app", 8 * GiB, 2 * GiB, v2_stat())

    assert host_memory(root=tmp_path) == HostMemory(GiB, 8 * GiB, "MemAvailable in /proc/meminfo")


def test_v2_max_at_every_level_gives_memavailable(tmp_path):
    meminfo(tmp_path, available=20 * GiB, total=32 * GiB)
    put(tmp_path, "proc/self/cgroup", "0::/user.slice/app.scope\n")
    v2_level(tmp_path, "user.slice/app.scope", "max", 3 * GiB, v2_stat(inactive=GiB))
    v2_level(tmp_path, "user.slice", "max", 5 * GiB, v2_stat(inactive=GiB))

    assert host_memory(root=tmp_path) == HostMemory(20 * GiB, 32 * GiB, "MemAvailable in /proc/meminfo")


def test_v2_usage_over_the_limit_leaves_nothing_and_cache_never_counts_past_usage(tmp_path):
    meminfo(tmp_path)
    put(tmp_path, "proc/self/cgroup", "0::/a/b\n")
    v2_level(tmp_path, "a/b", GiB, 2 * GiB, v2_stat())  # memory.max lowered under usage: nothing left
    v2_level(tmp_path, "a", 4 * GiB, GiB, v2_stat(inactive=8 * GiB))  # a stat that says more than usage

    found = host_memory(root=tmp_path)

    assert (found.available, found.total) == (0, GiB)
    assert "/sys/fs/cgroup/a/b: memory.max 1.0 GiB, 2.0 GiB in use of which 0 B reclaimable" in found.source


def test_v2_in_its_own_cgroup_namespace_reads_the_mount_point(tmp_path):
    meminfo(tmp_path, available=180 * GiB, total=187 * GiB)
    put(tmp_path, "proc/self/cgroup", "0::/\n")
    v2_level(tmp_path, "", 45_999_996_928, 40 * GiB, v2_stat(inactive=GiB))

    found = host_memory(root=tmp_path)

    assert (found.available, found.total) == (45_999_996_928 - 39 * GiB, 45_999_996_928)
    assert found.source.startswith("cgroup v2 /sys/fs/cgroup: memory.max 42.8 GiB, 40.0 GiB in use")


def test_v2_mount_point_and_root_come_from_mountinfo(tmp_path):
    meminfo(tmp_path)
    put(tmp_path, "proc/self/cgroup", "0::/machine/ctr/app\n")
    # Mounted elsewhere, showing the tree from /machine down, at a path with an escaped space.
    put(tmp_path, "proc/self/mountinfo",
        "22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n"
        "30 22 0:26 /machine /run/my\\040cgroups rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n")
    put(tmp_path, "run/my cgroups/ctr/memory.max", f"{3 * GiB}\n")
    put(tmp_path, "run/my cgroups/ctr/memory.current", f"{GiB}\n")
    put(tmp_path, "run/my cgroups/ctr/memory.stat", "inactive_file 0\nactive_file 0\nfile_dirty 0\n"
                                                    "file_writeback 0\nfile_mapped 0\n")
    v2_level(tmp_path, "ctr", GiB, GiB, v2_stat())  # the default mount: not the one mounted, never read

    found = host_memory(root=tmp_path)

    assert (found.available, found.total) == (2 * GiB, 3 * GiB)
    assert found.source.startswith("cgroup v2 /run/my cgroups/ctr: memory.max 3.0 GiB, 1.0 GiB in use")


# --- cgroup v1 -------------------------------------------------------------------------------------------------


def test_v1_with_a_limit(tmp_path):
    meminfo(tmp_path)
    put(tmp_path, "proc/self/cgroup", V1_CGROUP)
    put(tmp_path, "proc/self/mountinfo",
        "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
        "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n")
    # 2 GiB limit, 1.5 GiB in use, 768 MiB of file pages of which 256 MiB mapped: 1 GiB left.
    v1_level(tmp_path, "docker/abc", 2 * GiB, 1536 * MiB, v1_stat(inactive=512 * MiB, active=256 * MiB,
                                                                  mapped=256 * MiB))
    v1_level(tmp_path, "docker", V1_NO_LIMIT, 3 * GiB, v1_stat())
    v1_level(tmp_path, "", V1_NO_LIMIT, 9 * GiB, v1_stat())

    assert host_memory(root=tmp_path) == HostMemory(
        available=GiB, total=2 * GiB,
        source="cgroup v1 /sys/fs/cgroup/memory/docker/abc: memory.limit_in_bytes 2.0 GiB, 1.5 GiB in use of "
               "which 512.0 MiB reclaimable page cache",
    )


def test_v1_without_a_limit_gives_memavailable(tmp_path):
    meminfo(tmp_path, available=7 * GiB, total=8 * GiB)
    put(tmp_path, "proc/self/cgroup", V1_CGROUP)
    v1_level(tmp_path, "docker/abc", V1_NO_LIMIT, GiB, v1_stat(inactive=GiB))
    v1_level(tmp_path, "docker", "9223372036854710272", GiB, v1_stat())  # no limit, rounded to 64 KiB pages
    v1_level(tmp_path, "", V1_NO_LIMIT, GiB, v1_stat())

    assert host_memory(root=tmp_path) == HostMemory(7 * GiB, 8 * GiB, "MemAvailable in /proc/meminfo")


def test_v1_container_without_a_cgroup_namespace_sees_its_cgroup_at_the_mount_point(tmp_path):
    meminfo(tmp_path)
    put(tmp_path, "proc/self/cgroup", V1_CGROUP)
    put(tmp_path, "proc/self/mountinfo",
        "35 31 0:32 /docker/abc /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory\n")
    v1_level(tmp_path, "", 4 * GiB, GiB, v1_stat(active=GiB))

    found = host_memory(root=tmp_path)

    assert (found.available, found.total) == (4 * GiB, 4 * GiB)
    assert found.source.startswith("cgroup v1 /sys/fs/cgroup/memory: memory.limit_in_bytes 4.0 GiB")


# --- malformed and missing files -------------------------------------------------------------------------------


@pytest.mark.parametrize("garbage", ["lots\n", "-1\n", "", "1.5G\n", "\x00\xff", "9" * (100 * KiB)])
def test_malformed_memory_max_skips_that_level(tmp_path, garbage):
    meminfo(tmp_path)
    put(tmp_path, "proc/self/cgroup", "0::/a/b\n")
    v2_level(tmp_path, "a/b", garbage, GiB, v2_stat())
    v2_level(tmp_path, "a", 6 * GiB, 2 * GiB, v2_stat())

    found = host_memory(root=tmp_path)

    assert (found.available, found.total) == (4 * GiB, 6 * GiB)
    assert found.source.startswith("cgroup v2 /sys/fs/cgroup/a: ")


def test_missing_memory_stat_counts_no_page_cache(tmp_path):
    meminfo(tmp_path)
    put(tmp_path, "proc/self/cgroup", "0::/a\n")
    v2_level(tmp_path, "a", 6 * GiB, 2 * GiB)

    assert host_memory(root=tmp_path) == HostMemory(
        4 * GiB, 6 * GiB,
        "cgroup v2 /sys/fs/cgroup/a: memory.max 6.0 GiB, 2.0 GiB in use memory.stat unreadable, so no page cache "
        "counted",
    )


def test_stat_without_the_file_keys_counts_no_page_cache(tmp_path):
    meminfo(tmp_path)
    put(tmp_path, "proc/self/cgroup", "0::/a\n")
    v2_level(tmp_path, "a", 6 * GiB, 2 * GiB, {"anon": GiB, "inactive_file": "many", "active_file": GiB})

    assert host_memory(root=tmp_path).available == 4 * GiB


def test_malformed_current_and_cgroup_lines_fall_back_to_memavailable(tmp_path):
    meminfo(tmp_path, available=3 * GiB, total=4 * GiB)
    put(tmp_path, "proc/self/cgroup", "garbage\n0::relative\n::\n0::/a\n")
    v2_level(tmp_path, "a", GiB, "a lot")
    put(tmp_path, "proc/self/mountinfo", "short line\n1 2 3 4 5 6 - \n")

    assert host_memory(root=tmp_path) == HostMemory(3 * GiB, 4 * GiB, "MemAvailable in /proc/meminfo")


def test_a_cgroup_walk_never_leaves_the_mount(tmp_path):
    meminfo(tmp_path, available=3 * GiB, total=4 * GiB)
    put(tmp_path, "proc/self/cgroup", "0::/../../outside\n")
    put(tmp_path, "outside/memory.max", f"{GiB}\n")
    put(tmp_path, "outside/memory.current", "0\n")

    assert host_memory(root=tmp_path).source == "MemAvailable in /proc/meminfo"


# --- without /proc ---------------------------------------------------------------------------------------------


@pytest.fixture
def no_psutil(monkeypatch):
    monkeypatch.setitem(sys.modules, "psutil", None)  # `import psutil` now raises ImportError


def fake_sysconf(monkeypatch, values):
    def sysconf(name):
        if name not in values:
            raise ValueError(f"unrecognized configuration name {name!r}")
        return values[name]

    monkeypatch.setattr("os.sysconf", sysconf)


def test_no_proc_uses_psutil(tmp_path, monkeypatch):
    figures = types.SimpleNamespace(available=5 * GiB, total=16 * GiB)
    monkeypatch.setitem(sys.modules, "psutil", types.SimpleNamespace(virtual_memory=lambda: figures))

    assert host_memory(root=tmp_path) == HostMemory(5 * GiB, 16 * GiB, "psutil")


def test_no_proc_and_no_psutil_uses_sysconf(tmp_path, monkeypatch, no_psutil):
    fake_sysconf(monkeypatch, {"SC_PAGE_SIZE": 4 * KiB, "SC_AVPHYS_PAGES": 1000, "SC_PHYS_PAGES": 4000})

    assert host_memory(root=tmp_path) == HostMemory(4000 * KiB, 16000 * KiB, "sysconf")


def test_meminfo_without_memavailable_falls_back(tmp_path, monkeypatch, no_psutil):
    put(tmp_path, "proc/meminfo", "MemTotal: 8000 kB\nMemFree: 10 kB\n")  # kernels before 3.14
    fake_sysconf(monkeypatch, {"SC_PAGE_SIZE": 4 * KiB, "SC_AVPHYS_PAGES": 10, "SC_PHYS_PAGES": 2000})

    assert host_memory(root=tmp_path) == HostMemory(40 * KiB, 8000 * KiB, "sysconf")


def test_windows_uses_global_memory_status(tmp_path, monkeypatch, no_psutil):
    def global_memory_status(status):
        status._obj.ullAvailPhys, status._obj.ullTotalPhys = 6 * GiB, 64 * GiB
        return 1

    kernel32 = types.SimpleNamespace(GlobalMemoryStatusEx=global_memory_status)
    monkeypatch.setattr(ctypes, "windll", types.SimpleNamespace(kernel32=kernel32), raising=False)
    monkeypatch.setattr(sys, "platform", "win32")

    assert host_memory(root=tmp_path) == HostMemory(6 * GiB, 64 * GiB, "GlobalMemoryStatusEx")


def test_nothing_works_asks_for_the_budget(tmp_path, monkeypatch, no_psutil):
    fake_sysconf(monkeypatch, {"SC_PAGE_SIZE": 4 * KiB, "SC_PHYS_PAGES": 4000})  # macOS: no SC_AVPHYS_PAGES

    with pytest.raises(HostMemoryError, match=r"give the host budget in bytes"):
        host_memory(root=tmp_path)


def test_a_cgroup_limit_answers_when_the_machine_figure_is_missing(tmp_path, monkeypatch, no_psutil):
    fake_sysconf(monkeypatch, {})
    put(tmp_path, "proc/self/cgroup", "0::/a\n")
    v2_level(tmp_path, "a", 2 * GiB, GiB, v2_stat())

    found = host_memory(root=tmp_path)

    assert (found.available, found.total) == (GiB, 2 * GiB)


# --- this machine ----------------------------------------------------------------------------------------------


def test_this_machine():
    found = host_memory()

    assert 0 < found.available <= found.total, found

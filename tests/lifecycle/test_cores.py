"""How many torch threads a command takes: cores, a cgroup's CPU quota.

(OpenMP's wait policy, set as a fresh process starts: ``test_imports.py``.)
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from lifecycle.cli.cgroups import cpu_quota, v1_quota, v2_quota
from lifecycle.cli.cores import Cpus, Threads, physical_cores, torch_threads

ROOT = Path(__file__).resolve().parents[2]

V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,relatime shared:4 - cgroup2 cgroup2 rw"
V1_MOUNT = (
    "32 31 0:29 {root} /sys/fs/cgroup/cpu,cpuacct rw,nosuid,nodev,noexec,relatime shared:9 "
    "- cgroup cgroup rw,cpu,cpuacct"
)
V1_MEMORY = (
    "35 31 0:32 / /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime shared:12 "
    "- cgroup cgroup rw,memory"
)


def topology(tmp_path: Path, siblings: dict[int, str]) -> Path:
    """Write a ``/sys/devices/system/cpu`` lookalike: each CPU with its sibling list."""
    for cpu, text in siblings.items():
        folder = tmp_path / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        (folder / "thread_siblings_list").write_text(text + "\n")
    return tmp_path


def machine(root: Path, cgroup: str, mountinfo: list[str], files: dict[str, str]) -> Path:
    """Write a machine's ``/proc/self`` and cgroup files under ``root``; return ``root``."""
    proc = root / "proc" / "self"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(cgroup + "\n")
    (proc / "mountinfo").write_text("\n".join(mountinfo) + "\n")
    for path, text in files.items():
        file = root / path.lstrip("/")
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(text + "\n")
    return root


class TestPhysicalCores:
    def test_hyperthreads_of_one_core_count_once(self, tmp_path: Path) -> None:
        """Two SMT siblings on each of two cores make two physical cores."""
        root = topology(tmp_path, {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"})
        assert physical_cores({0, 1, 2, 3}, root) == 2

    def test_only_the_allowed_cpus_count(self, tmp_path: Path) -> None:
        """CPUs outside the process's affinity add nothing."""
        root = topology(tmp_path, {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"})
        assert physical_cores({0, 2}, root) == 1

    def test_without_topology_every_cpu_counts(self, tmp_path: Path) -> None:
        """Where SMT cannot be read, each logical CPU counts as a core."""
        assert physical_cores({0, 1, 2}, tmp_path) == 3

    def test_this_machine_has_at_least_one(self) -> None:
        """The process's own cores are at least one and at most its logical CPUs."""
        assert 1 <= physical_cores() <= len(os.sched_getaffinity(0))


class TestCpuQuota:
    def test_quota_texts(self) -> None:
        """v2's ``cpu.max`` and v1's quota over period read as CPUs; ``max`` and -1 as none."""
        assert v2_quota("150000 100000\n") == 1.5
        assert v2_quota("max 100000\n") is None
        assert v1_quota("50000\n", "100000\n") == 0.5
        assert v1_quota("-1\n", "100000\n") is None

    def test_v2_pod_of_one_cpu(self, tmp_path: Path) -> None:
        """A container's own ``cpu.max`` under the unified hierarchy is its quota."""
        root = machine(
            tmp_path,
            "0::/kubepods/pod1/c1",
            [V2_MOUNT],
            {
                "/sys/fs/cgroup/kubepods/pod1/c1/cpu.max": "100000 100000",
                "/sys/fs/cgroup/kubepods/pod1/cpu.max": "max 100000",
            },
        )
        assert cpu_quota(root) == 1.0

    def test_v2_a_parent_caps_its_children(self, tmp_path: Path) -> None:
        """A tighter quota on a parent cgroup binds a child that sets none."""
        root = machine(
            tmp_path,
            "0::/kubepods/pod1/c1",
            [V2_MOUNT],
            {
                "/sys/fs/cgroup/kubepods/pod1/c1/cpu.max": "max 100000",
                "/sys/fs/cgroup/kubepods/pod1/cpu.max": "50000 100000",
                "/sys/fs/cgroup/kubepods/cpu.max": "400000 100000",
            },
        )
        assert cpu_quota(root) == 0.5

    def test_v2_namespaced_container_reads_its_mount_point(self, tmp_path: Path) -> None:
        """Inside a cgroup namespace the process's cgroup is the mount's root: read it there."""
        root = machine(tmp_path, "0::/", [V2_MOUNT], {"/sys/fs/cgroup/cpu.max": "200000 100000"})
        assert cpu_quota(root) == 2.0

    def test_v2_without_a_quota(self, tmp_path: Path) -> None:
        """``max`` everywhere, or no ``cpu.max`` at all (the root's), is no quota."""
        root = machine(
            tmp_path, "0::/user.slice", [V2_MOUNT], {"/sys/fs/cgroup/user.slice/cpu.max": "max"}
        )
        assert cpu_quota(root) is None

    def test_v1_cpu_controller(self, tmp_path: Path) -> None:
        """v1's quota over period, from the hierarchy that holds the ``cpu`` controller."""
        root = machine(
            tmp_path,
            "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/",
            [V1_MEMORY, V1_MOUNT.format(root="/docker/abc")],
            {
                "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "150000",
                "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000",
                "/sys/fs/cgroup/memory/cpu.cfs_quota_us": "10000",  # not the cpu controller's
                "/sys/fs/cgroup/memory/cpu.cfs_period_us": "100000",
            },
        )
        assert cpu_quota(root) == 1.5

    def test_v1_path_under_the_host_root(self, tmp_path: Path) -> None:
        """A v1 cgroup below the mount's root is read in its own folder, then its parents."""
        root = machine(
            tmp_path,
            "4:cpu,cpuacct:/batch/job7",
            [V1_MOUNT.format(root="/")],
            {
                "/sys/fs/cgroup/cpu,cpuacct/batch/job7/cpu.cfs_quota_us": "-1",
                "/sys/fs/cgroup/cpu,cpuacct/batch/job7/cpu.cfs_period_us": "100000",
                "/sys/fs/cgroup/cpu,cpuacct/batch/cpu.cfs_quota_us": "300000",
                "/sys/fs/cgroup/cpu,cpuacct/batch/cpu.cfs_period_us": "100000",
                "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1",
                "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000",
            },
        )
        assert cpu_quota(root) == 3.0

    def test_hybrid_without_a_quota(self, tmp_path: Path) -> None:
        """v1's -1 and a unified hierarchy without the cpu controller: no quota."""
        root = machine(
            tmp_path,
            "4:cpu:/\n0::/",
            [
                "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu",
                "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw",
            ],
            {
                "/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1",
                "/sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000",
                "/sys/fs/cgroup/unified/cgroup.procs": "1",
            },
        )
        assert cpu_quota(root) is None

    def test_nothing_to_read(self, tmp_path: Path) -> None:
        """No ``/proc`` (not Linux) or nothing mounted: no quota."""
        assert cpu_quota(tmp_path) is None
        assert cpu_quota(machine(tmp_path / "bare", "0::/", [], {})) is None


class TestTorchThreads:
    def test_a_requested_count_wins(self) -> None:
        """``--threads`` is taken as given, for run and serve alike."""
        assert torch_threads(7, processes=4, event_loop=True) == Threads(7, "--threads")

    def test_default_is_the_physical_cores(self) -> None:
        """Without a quota, run takes every physical core and says so."""
        assert torch_threads(None, cpus=Cpus(2, None)) == Threads(2, "2 physical cores")
        assert torch_threads(None, cpus=Cpus(1, None)) == Threads(1, "1 physical core")

    def test_a_quota_below_the_cores_binds(self) -> None:
        """A pod limited to 1 CPU on a 64-core node starts one thread; fractions round down."""
        assert torch_threads(None, cpus=Cpus(64, 1.0)) == Threads(1, "cgroup quota 1.0 CPU")
        assert torch_threads(None, cpus=Cpus(64, 2.5)) == Threads(2, "cgroup quota 2.5 CPUs")
        assert torch_threads(None, cpus=Cpus(64, 0.5)) == Threads(1, "cgroup quota 0.5 CPU")

    def test_a_quota_above_the_cores_does_not(self) -> None:
        """A quota of more CPUs than the process has cores changes nothing."""
        assert torch_threads(None, cpus=Cpus(2, 4.0)) == Threads(2, "2 physical cores")

    def test_workers_share_and_serve_leaves_one(self) -> None:
        """The workers of a node split the CPUs; serve leaves one to its event loop."""
        cpus = Cpus(8, None)
        assert torch_threads(None, processes=2, cpus=cpus) == Threads(
            4, "8 physical cores shared by 2 workers"
        )
        assert torch_threads(None, event_loop=True, cpus=Cpus(16, 4.0)) == Threads(
            3, "cgroup quota 4.0 CPUs, less one for the HTTP event loop"
        )

    def test_never_below_one(self) -> None:
        """More workers than CPUs, or one CPU and an event loop, still get one thread."""
        assert torch_threads(None, processes=8, event_loop=True, cpus=Cpus(2, None)).count == 1
        assert torch_threads(None, event_loop=True, cpus=Cpus(1, None)).count == 1

    def test_this_machine(self) -> None:
        """On this machine the default is within its cores and its quota, if it has one."""
        threads, cores, quota = torch_threads(None), physical_cores(), cpu_quota()
        assert 1 <= threads.count <= cores
        assert quota is None or threads.count <= max(1, math.floor(quota))
        binds = quota is not None and math.floor(quota) < cores
        assert threads.reason.startswith("cgroup quota" if binds else f"{cores} physical core")

"""``lifecycle run`` on several processes: torchrun, ``--nproc``, and a killed rank.

``--nproc`` runs torchrun's agent in the command's own process and forks the workers
from it, so most tests call the command in this one: the workers are forks of this
test's process. The killed rank, a line left in a buffer, and torchrun started by hand
run the command as a process forked from the fork server (``tests.processes``), which
imported torch already; the workers torchrun starts are new interpreters, as torchrun
makes them.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lifecycle.cli import launch
from tests.conftest import Lifecycle
from tests.processes import Finished, Program, run_python, start_python

pytestmark = pytest.mark.long

ROOT = Path(__file__).resolve().parents[2]
ULYSSES = ROOT / "examples" / "parallel" / "tiny_t2i_ulysses.toml"
DATA_PARALLEL = ROOT / "examples" / "parallel" / "tiny_t2i_data_parallel.toml"
DEADLINE_S = 180


def events(stderr: str) -> list[dict[str, object]]:
    """Return the JSON log events in ``stderr`` (torchrun's own lines are not JSON).

    Two workers share stderr, so one line may hold events of both ranks back to back.
    """
    decoder = json.JSONDecoder()
    found = []
    for line in stderr.splitlines():
        at = 0
        while line.startswith("{", at):
            event, at = decoder.raw_decode(line, at)
            found.append(event)
    return found


def workers(launcher: int) -> list[int]:
    """Return the workers ``launcher`` forked, by rank (Linux ``/proc``).

    The launcher forks rank 0 first, and the kernel lists a thread's children in the
    order they were started (a forked worker's ``/proc/PID/environ`` is the launcher's,
    without the ``RANK`` it set after the fork).
    """
    found: list[int] = []
    for task in Path(f"/proc/{launcher}/task").iterdir():
        found += [int(p) for p in (task / "children").read_text().split()]
    return found


def command_line(pid: int) -> bytes:
    """Return the command line ``pid`` was started with (Linux ``/proc``)."""
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def write_four_processes(folder: Path) -> Path:
    """Write the Ulysses spec with a layout of four processes, which two ranks refuse at load."""
    spec = folder / "four.toml"
    spec.write_text(ULYSSES.read_text().replace("sp_degree = 2\nulysses_degree = 2", "tp_size = 4"))
    return spec


@pytest.fixture
def four_processes(tmp_path: Path) -> Path:
    """The spec of ``write_four_processes`` in the test's folder."""
    return write_four_processes(tmp_path)


RENDEZVOUS = "torch.distributed.elastic.rendezvous."
"""The package of torchrun's rendezvous backends; each is imported when first created."""

BUFFERED_LAUNCH = f"""
import sys
from lifecycle.cli.main import main
sys.stdout.reconfigure(line_buffering=False, write_through=False)
sys.stdout.write("written before the launch\\n")  # waits in the buffer
code = main(sys.argv[1:])
loaded = sorted(name for name in sys.modules if name.startswith({RENDEZVOUS!r}))
print("rendezvous modules:", *loaded, file=sys.stderr)
sys.exit(code)
"""
"""``run --nproc`` in a program of its own with a line in stdout's buffer; at the end it
names the rendezvous modules the launch imported."""


@pytest.fixture(scope="module")
def buffered_launch(tmp_path_factory: pytest.TempPathFactory) -> Finished:
    """What ``BUFFERED_LAUNCH`` left, launching two ranks that refuse the four-process spec."""
    spec = write_four_processes(tmp_path_factory.mktemp("four"))
    argv = ["run", spec, "--nproc", "2", "--requests", "1"]
    return run_python(BUFFERED_LAUNCH, *argv, cwd=ROOT, timeout=DEADLINE_S)


class TestRun:
    def test_nproc_starts_the_workers_through_torchrun(
        self, tmp_path: Path, lifecycle_fd: Lifecycle
    ) -> None:
        """``--nproc 2`` runs Ulysses on two ranks; rank 0 alone prints; events carry rank."""
        timeline = tmp_path / "timeline.mmd"
        result = lifecycle_fd(
            "run", ULYSSES, "--nproc", "2", "--requests", "2", "--steps", "2", "--json-logs",
            "--json", "--timeline", timeline,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        (line,) = result.stdout.splitlines()  # rank 0 alone prints its one JSON object
        printed = json.loads(line)
        assert (printed["summary"]["pipeline"], printed["summary"]["requests"]) == (
            "tiny-t2i-ulysses",
            2,
        )
        assert printed["snapshot"]["components"]["transformer"]["state"] == "resident"
        sections = [line for line in timeline.read_text().splitlines() if "section" in line]
        assert sections == [
            f"    section rank {rank} {component}"
            for rank in (0, 1)
            for component in ("text_encoder", "transformer", "vae")
        ]
        logged = events(result.stderr)
        assert {event["rank"] for event in logged} == {0, 1}
        assert all("rank" in event for event in logged)

    def test_torchrun_splits_requests_across_data_parallel_replicas(self) -> None:
        """Under torchrun with dp_size = 2, each replica runs every other request."""
        result = run_python(
            "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "lifecycle", "run", DATA_PARALLEL, "--requests", "4", "--steps", "2",
            "--json-logs", cwd=ROOT, module=True, timeout=DEADLINE_S,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        assert "pipeline 'tiny-t2i-dp': 2 requests x 2 steps" in result.stdout
        begun = {
            (e["rank"], e["request_id"])
            for e in events(result.stderr)
            if e["event"] == "request.begin"
        }
        assert {rid for rank, rid in begun if rank == 0} == {"r1", "r3"}
        assert {rid for rank, rid in begun if rank == 1} == {"r2", "r4"}

    def test_a_line_left_in_a_buffer_is_printed_once(self, buffered_launch: Finished) -> None:
        """A line the launcher wrote but had not flushed is not written again by its forks."""
        result = buffered_launch
        assert result.returncode == 1, result.stderr[-3000:]  # each rank refuses the layout
        assert result.stdout.count("written before the launch") == 1, result.stdout

    def test_the_workers_meet_on_a_static_rendezvous(self, buffered_launch: Finished) -> None:
        """``--nproc`` meets its workers on torchrun's static rendezvous, not on the c10d one
        (which looks up the module of every frame on the stack at each of its steps)."""
        (line,) = [
            line
            for line in buffered_launch.stderr.splitlines()
            if line.startswith("rendezvous modules:")
        ]
        loaded = line.split()[2:]
        assert RENDEZVOUS + "static_tcp_rendezvous" in loaded, line
        assert RENDEZVOUS + "c10d_rendezvous_backend" not in loaded, line


class TestNodes:
    @pytest.mark.slow
    def test_two_nodes_rendezvous_on_localhost(self) -> None:
        """Two torchrun invocations of one worker each form one data-parallel run."""
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
        job = ["-m", "lifecycle", "run", str(DATA_PARALLEL), "--requests", "2", "--steps", "2"]
        nodes = [
            subprocess.Popen(
                [
                    *[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"],
                    *["--node-rank", str(node), "--nproc-per-node", "1", "--max-restarts", "0"],
                    *rendezvous,
                    *job,
                ],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for node in range(2)
        ]
        outputs = []
        try:
            outputs = [node.communicate(timeout=DEADLINE_S) for node in nodes]
        finally:
            for node in nodes:
                if node.poll() is None:
                    node.kill()
                    node.communicate()
        assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-3000:]
        printed = [out.count("pipeline 'tiny-t2i-dp': 1 request x 2 steps") for out, _ in outputs]
        assert sorted(printed) == [0, 1]


class TestStart:
    @pytest.mark.parametrize(("is_cuda_initialized", "method"), [(False, "fork"), (True, "spawn")])
    def test_workers_are_forked_unless_cuda_is_initialized(
        self, is_cuda_initialized: bool, method: str
    ) -> None:
        """The launcher forks its workers, and spawns them once CUDA is initialized."""
        assert launch.start_method(is_cuda_initialized) == method

    def test_a_fork_computes_in_parallel_after_openmp_is_released(self) -> None:
        """A fork of a process that ran OpenMP threads runs its own parallel region."""
        torch.set_num_threads(2)  # process_state puts the count back
        torch.ones(1000, 1000).exp()  # OpenMP's threads start, and stay
        launch.release_openmp_threads()
        child = multiprocessing.get_context("fork").Process(target=_exp_on_two_threads)
        child.start()
        child.join(DEADLINE_S)  # an inherited pool without its threads waits forever
        if child.exitcode is None:
            child.kill()
            child.join()
        assert child.exitcode == 0


def _exp_on_two_threads() -> None:
    torch.set_num_threads(2)
    torch.ones(1000, 1000).exp()


class TestFaults:
    def test_a_refusal_on_every_rank_exits_one(
        self, four_processes: Path, lifecycle_fd: Lifecycle
    ) -> None:
        """A 4-process layout started on 2 ranks is refused on each; exit 1 names them."""
        result = lifecycle_fd("run", four_processes, "--nproc", "2", "--requests", "1")
        assert result.returncode == 1, result.stderr[-3000:]
        refused = "parallel.invalid_layout  the parallel layout needs 4 processes, but 2 were"
        # The rank refused first exits 1. torchrun then stops the other with SIGTERM,
        # maybe before it printed its own refusal: it is named, but exits 143 (or is
        # killed by the signal). Every rank that exited 1 printed its refusal first (rank 0
        # on stdout, the other on stderr).
        exited_one = result.stderr.count("failed: exit code 1")
        printed = (result.stdout + result.stderr).count(refused)
        assert 1 <= exited_one <= printed <= 2, result.stderr[-3000:]
        assert all(f"lifecycle run: rank {rank} failed: " in result.stderr for rank in (0, 1))

    def test_a_killed_rank_ends_the_run(self) -> None:
        """Killing one forked worker stops the other within the deadline, exit 3 naming it."""
        with start_python("lifecycle", *SERVING, cwd=ROOT, module=True) as program:
            wait_until_serving(program)
            ranks = workers(program.pid)
            # forks of the launcher, running its program: no new interpreter was started
            assert [command_line(pid) for pid in ranks] == [command_line(program.pid)] * 2
            os.kill(ranks[1], signal.SIGKILL)
            result = program.wait(timeout=DEADLINE_S)
        assert result.returncode == 3, result.stderr[-3000:]
        assert "lifecycle run: rank 1 failed: killed by signal 9" in result.stderr
        assert not any(Path(f"/proc/{pid}").exists() for pid in ranks)

    @pytest.mark.parametrize(
        ("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["INT", "TERM"]
    )
    def test_a_signal_to_the_launcher_stops_cleanly(
        self, signum: signal.Signals, code: int
    ) -> None:
        """SIGINT or SIGTERM to ``run --nproc`` stops every worker: 128 + signal, no traceback."""
        with start_python("lifecycle", *SERVING, cwd=ROOT, module=True) as program:
            wait_until_serving(program)
            ranks = workers(program.pid)
            program.send_signal(signum)
            result = program.wait(timeout=DEADLINE_S)
        assert result.returncode == code, result.stderr[-3000:]
        assert "Traceback" not in result.stderr
        assert f"; stopped by {signum.name}\n" in result.stdout
        assert not any(Path(f"/proc/{pid}").exists() for pid in ranks)


SERVING: list[str | Path] = ["run", DATA_PARALLEL, "--nproc", "2", "--json-logs"]
SERVING += ["--requests", "100000", "--steps", "4"]
"""A data-parallel run that serves requests on both ranks until it is stopped."""


def wait_until_serving(program: Program) -> None:
    """Return once both ranks of ``program`` (``SERVING``) have logged a request."""
    deadline = time.monotonic() + DEADLINE_S
    serving: set[object] = set()
    while serving != {0, 1}:
        assert program.process.is_alive(), program.stderr()[-3000:]
        assert time.monotonic() < deadline, "both ranks should be serving requests"
        time.sleep(0.05)
        written = program.stderr()
        lines = written[: written.rfind("\n") + 1]  # the last may be half written
        # a request's own event: admission's transitions carry ``request_id: null``, and a
        # rank killed then leaves its peer blocked joining the process group
        serving = {e["rank"] for e in events(lines) if e.get("request_id")}

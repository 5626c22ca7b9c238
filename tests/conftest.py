"""Markers and fixtures shared by every test folder.

xdist's controller process loads this file too and runs no test: torch and the project
are imported where a hook or fixture of a test-running process needs them, not here (3
CPU-seconds the controller spent before it started the workers).
"""

from __future__ import annotations

import gc
import io
import os
import shlex
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, TypeAlias

import pytest
import structlog

if TYPE_CHECKING:
    import torch

    from attention import Platform
    from benchmarks.make_pipeline import Family


def pytest_configure(config: pytest.Config) -> None:
    """Give the test runs one inductor cache, kept between runs; share the cores among
    xdist workers: each one's torch computes on its part of them; collect garbage less
    often in the workers.

    Two workers with a thread a core each would run twice as many threads as cores,
    which spin waiting for each other. xdist's controller runs no test and takes no
    threads.
    """
    # inductor's compiled code of the test runs, in a folder of its own, never the user's
    # cache: pytest's cache folder keeps it between runs (--cache-clear empties it), so
    # the C++ builds of the compile tests' kernels (about 2 CPU-s each) and of inductor's
    # probe of the CPU's vector instructions (about 10) run once, not every run. Inductor
    # keys a kept build by the graph, torch's version, its config, the compiler and the
    # CPU: it is the code a fresh build makes, and dynamo still traces every graph and
    # hands it to the component's compile (its counts are the same). The controller sets
    # it before it starts the workers, which inherit it; -p no:cacheprovider: this run's.
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        cache = getattr(config, "cache", None)
        if cache is not None:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache.mkdir("inductor"))
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="lifecycle-inductor-")
            config.add_cleanup(partial(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], True))
    # one compile thread: more start a pool of Python processes, each importing torch, to
    # run the C++ builds beside each other on the cores the xdist workers already use
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    if _is_controller(config):
        # a run of the whole suite starts programs in every worker: they fork them from
        # one server (a focused run may start none, and pays for no server), which forks
        # the workers too: each is born with torch imported
        if config.args_source == pytest.Config.ArgsSource.TESTPATHS:
            from tests.processes import share_fork_server

            share_fork_server()
            forked = shlex.join([sys.executable, str(Path(__file__).with_name("forked_python.py"))])
            config.option.tx = [f"popen//python={forked}" for _ in config.option.tx]
        return
    # A worker holds half a million objects once it has imported torch and collected, a
    # million by its end: each full collection walks them all (0.3 CPU-s), and at
    # CPython's first threshold (700) the tests' short-lived tensors' wrappers, events and
    # frames were promoted often enough for 17 of them a worker, 6.4 CPU-s of 60. At
    # 10,000 most die young: 3 or 4 full collections, 2.1-2.7 CPU-s a worker.
    from tests.processes import GC_THRESHOLD

    gc.set_threshold(GC_THRESHOLD)
    import torch

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, torch.get_num_threads() // workers))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put ``long`` files first; skip ``cuda`` tests where no CUDA device is present.

    xdist hands whole files to its workers in this order: a long file handed out last
    would end the run on one worker while the others wait.
    """
    import torch

    items.sort(key=lambda item: item.get_closest_marker("long") is None)  # stable
    if torch.cuda.is_available():
        return  # the cuda tests run where a GPU is lent
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Freeze every object left once a test-running process's tests are done.

    pytest's unraisable-exception plugin then collects garbage twice more (its
    ``pytest_unconfigure`` and its cleanup), each a full collection that walked the
    worker's near million objects: 1.1-1.3 CPU-s a worker, at the very end of the run.
    Frozen, they walk only what the end itself makes. A ``__del__`` that would have raised
    in a cycle left from the tests is not reported at the end: that report came after the
    summary and failed nothing.
    """
    if not _is_controller(session.config):  # few objects there, and it ran no test
        gc.freeze()


def _is_controller(config: pytest.Config) -> bool:
    """Tell whether this process is xdist's controller, which starts workers and runs no test."""
    return bool(getattr(config.option, "numprocesses", None)) and not hasattr(config, "workerinput")


@pytest.fixture(scope="session")
def root() -> Path:
    """The repository root: examples, diagrams and the README are found from here."""
    return Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def cpu() -> Platform:
    """A CPU platform built explicitly, so selection does not depend on this machine."""
    from attention import Platform

    return Platform("cpu")


@pytest.fixture(autouse=True)
def fixed_seed() -> None:
    """Seed torch's global generators before each test, so implicit draws (layer init) repeat.

    The CPU generator is seeded directly, and CUDA's where a device is present:
    ``torch.manual_seed`` also queues a seed for each accelerator torch has not started
    (CUDA, XPU, MTIA), formatting the calling stack for each, 0.6 ms of every test.
    """
    import torch

    torch.default_generator.manual_seed(0)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(0)


HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
"""``run`` and ``serve`` handle the first two; the torchrun agent that ``run --nproc``
starts in its own process handles all four."""


@pytest.fixture(autouse=True)
def process_state() -> Iterator[None]:
    """Put back what a test changed of the process: logging, torch threads, signals, env.

    The CLI configures structlog and sets torch's thread count; ``serve`` and ``run``
    install signal handlers, and torchrun sets ``OMP_NUM_THREADS``. A test that leaks
    one of them would change every later test on the same worker, in an order that
    depends on how the suite is split.
    """
    import torch

    from lifecycle.logs import saved_logging

    context = structlog.contextvars.get_contextvars()
    threads = torch.get_num_threads()
    handlers = {number: signal.getsignal(number) for number in HANDLED_SIGNALS}
    # the project's loggers follow the logging configuration put back
    with saved_logging(), kept_environment():
        yield
    if structlog.contextvars.get_contextvars() != context:
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(**context)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    for number, handler in handlers.items():
        if signal.getsignal(number) is not handler:
            signal.signal(number, handler)


@contextmanager
def kept_environment() -> Iterator[None]:
    """Put back, on exit, each environment variable the block added, changed or deleted."""
    environ = environment()
    try:
        yield
    finally:
        now = environment()
        for key in now.keys() - environ.keys():
            del os.environ[key]
        for key, value in environ.items():
            if now.get(key) != value:
                os.environ[key] = value


def environment() -> dict[str, str]:
    """Return the process's environment, less ``PYTEST_CURRENT_TEST``.

    pytest sets that variable to each phase of a test: compared with it, every test's
    environment differed at its end and was cleared and set again whole, about a third of
    a trivial test's cost. Only the variables a test changed are put back.
    """
    found = dict(os.environ)
    found.pop("PYTEST_CURRENT_TEST", None)
    return found


class CliResult(NamedTuple):
    """What one call of the ``lifecycle`` command returned and printed."""

    returncode: int
    stdout: str
    stderr: str


Lifecycle: TypeAlias = Callable[..., CliResult]
"""Call the ``lifecycle`` command in this process with these arguments (str or Path)."""


def cli_caller(capture: pytest.CaptureFixture[str]) -> Lifecycle:
    """Return a caller of ``lifecycle.cli.main`` that reads the output back from ``capture``."""

    def call(*args: str | Path) -> CliResult:
        capture.readouterr()  # what the test printed before is not the command's
        from lifecycle.cli.main import main

        code = main([str(arg) for arg in args])
        out, err = capture.readouterr()
        return CliResult(code, out, err)

    return call


@pytest.fixture
def lifecycle(capsys: pytest.CaptureFixture[str]) -> Lifecycle:
    """Call ``lifecycle.cli.main`` in this process; its exit code is the return value.

    ``process_state`` puts back the logging configuration, thread count and signal
    handlers it set.
    """
    return cli_caller(capsys)


@pytest.fixture
def lifecycle_fd(capfd: pytest.CaptureFixture[str]) -> Lifecycle:
    """Call ``lifecycle.cli.main`` here, reading stdout and stderr at the file descriptors.

    What processes it starts write there too: the workers of ``run --nproc``.
    """
    return cli_caller(capfd)


def decode_png(data: bytes) -> torch.Tensor:
    """Decode a PNG with Pillow, which checks every chunk; return its pixels ``(H, W, 3)``.

    The image must be 8-bit RGB, what the project writes.
    """
    import torch
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        image.verify()  # chunk CRCs and structure; the image must be opened again after
    with Image.open(io.BytesIO(data)) as image:
        assert (image.format, image.mode) == ("PNG", "RGB"), (image.format, image.mode)
        pixels = bytearray(image.tobytes())
        return torch.frombuffer(pixels, dtype=torch.uint8).reshape(image.height, image.width, 3)


class PipelineFolders:
    """Tiny diffusers-format pipeline folders, each written once per test run when first asked.

    Args:
        root: where the folders are written.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.written: dict[str, Path] = {}

    def __call__(self, family: Family, *, smooth_time: bool = False) -> Path:
        """Return the tiny folder of ``family``; ``smooth_time``: the one whose adjacent
        denoising steps differ as a trained model's do (for step caches, design §17)."""
        from benchmarks.make_pipeline import write_pipeline

        name = f"{family}-smooth-time" if smooth_time else family
        if name not in self.written:
            self.written[name] = write_pipeline(family, self.root / name, smooth_time=smooth_time)
        return self.written[name]


@pytest.fixture(scope="session")
def pipeline_folder(tmp_path_factory: pytest.TempPathFactory) -> PipelineFolders:
    """Write tiny pipeline folders with seeded weights (``benchmarks.make_pipeline``) on demand.

    Skips where the ``diffusers`` extra is not installed: the folders are written by
    diffusers' and transformers' own classes.
    """
    from components.libraries import is_importable

    for library in ("diffusers", "transformers", "tokenizers"):
        if not is_importable(library):
            pytest.skip(f"{library} is not installed: pip install 'pipeline-lifecycle[diffusers]'")
    return PipelineFolders(tmp_path_factory.mktemp("pipelines"))


@pytest.fixture
def one_thread() -> None:
    """Run the test with one torch thread: tiny models run faster alone on a shared machine.

    (Two OpenMP threads on a busy 2-core machine spin against each other: a tiny
    pipeline request measured 0.3 s with one thread and 4 s with two.) ``process_state``
    puts the count back.
    """
    import torch

    torch.set_num_threads(1)

"""How the pipelines of a running worker change: add, remove, swap and reload (design §13).

One change at a time (``Worker.changing``). No request is lost: requests for a
pipeline being replaced wait at its gate and run on whichever pipeline serves after
(the new one, or the old one restored); its queued and running jobs finish first.

A swap replaces a pipeline by a new one of the same name:

- when the budget holds both (the new one is admitted beside the old), the new one
  loads while the old one serves, takes over, and the old one is drained and released;
- otherwise the old one is drained, its components the new one does not share are
  released, and the new one is admitted again and loaded.

When the new one fails to load, the old one is loaded again (sharing whatever it still
holds) and serves; the outcome says so, with the cause.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import msgspec

from lifecycle.events import PipelineReloaded, PipelineRestored, PipelineSwapped, ReloadOutcome
from lifecycle.logs import get_logger
from lifecycle.orchestrator import Orchestrator
from lifecycle.refusals import AdmissionRefused, RefusalCode
from lifecycle.serving.served import ServedPipeline
from lifecycle.serving.worker import REMOVED, SWAPPING, Worker
from lifecycle.spec.errors import ConfigError
from lifecycle.spec.reading import load_spec
from lifecycle.spec.structs import PipelineSpec

__all__ = ["ChangeOutcome", "RestoreFailed", "add", "reload", "reload_all", "remove"]

log = get_logger("lifecycle")

MEMORY_CODES = frozenset({RefusalCode.MEMORY_BUDGET, RefusalCode.HOST_MEMORY})
"""Refusals that only say the device or host cannot hold the new pipeline beside the old."""


class ChangeOutcome(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a change did, as the admin routes answer it.

    Attributes:
        name: the pipeline's name.
        action: ``added``, ``swapped``, ``unchanged`` or ``removed``.
        overlapped: a swap loaded the new pipeline while the old one served.
        kept: the components the new pipeline shares with the old, kept loaded across.
        restored: the new pipeline failed to load; the old one was loaded again and serves.
        cause: why the new one failed, when restored.
        finished: a removal's queued and running jobs all finished.
    """

    name: str
    action: Literal["added", "swapped", "unchanged", "removed"]
    overlapped: bool = False
    kept: tuple[str, ...] = ()
    restored: bool = False
    cause: str | None = None
    finished: bool = True


class RestoreFailed(RuntimeError):
    """A swap's new pipeline failed, and so did loading the old one again: neither serves."""


def add(worker: Worker, path: Path) -> ChangeOutcome:
    """Admit and load the pipeline of the spec at ``path``; one of its name already served
    is swapped for it.

    Raises:
        ConfigError: the spec is bad.
        AdmissionRefused: admission refused it; nothing changed.
        TransitionFailed, TransitionRefused: it failed to load (a new name: nothing changed).
        RestoreFailed: a swap failed and the old pipeline could not be loaded again.
    """
    spec = load_spec(path)
    with worker.changing:
        served = worker.pipelines.get(spec.name)
        if served is not None:
            return swap(worker, served, spec, path)
        orchestrator = worker.build(spec)
        with _closed_on_failure(orchestrator):
            orchestrator.admit()
            worker.put(worker.serve(orchestrator, path))
        return ChangeOutcome(name=spec.name, action="added")


def remove(worker: Worker, name: str) -> ChangeOutcome:
    """Drain pipeline ``name`` (its queued and running jobs finish) and release it.

    Requests waiting for it are answered that it is gone.

    Raises:
        UnknownModel: no such pipeline.
    """
    with worker.changing:
        served = worker.resolve(name)
        served.gate.close(REMOVED)
        try:
            finished = worker.retire(served)
        finally:
            worker.drop(served)
            served.gate.wake_waiters()
        return ChangeOutcome(name=name, action="removed", finished=finished)


def reload(worker: Worker, name: str) -> ChangeOutcome:
    """Read pipeline ``name``'s spec again: an unchanged one is left alone, a changed one
    (admitted first) is swapped in.

    Raises:
        UnknownModel: no such pipeline.
        ValueError: the pipeline was not read from a file.
        ConfigError: the spec is bad now; nothing changed.
        AdmissionRefused: admission refused the new spec; nothing changed.
        RestoreFailed: the swap failed and the old pipeline could not be loaded again.
    """
    with worker.changing:
        served = worker.resolve(name)
        if served.path is None:
            raise ValueError(f"pipeline '{name}' was not read from a spec file: nothing to reload")
        path = served.path
        try:
            spec = load_spec(path)
            if spec.name != name:
                raise ConfigError(
                    f"Expected name = '{name}' (the pipeline it reloads), got '{spec.name}'; "
                    "serve a renamed pipeline with POST /v1/pipelines",
                    "$.name",
                    str(path),
                )
            if spec == served.spec:
                _reloaded(served.orchestrator, path, "unchanged")
                return ChangeOutcome(name=name, action="unchanged")
            outcome = swap(worker, served, spec, path)
        except (ConfigError, AdmissionRefused):
            _reloaded(served.orchestrator, path, "refused")
            raise
        now = worker.pipelines.get(name)
        if now is not None:
            _reloaded(now.orchestrator, path, "restored" if outcome.restored else "swapped")
        return outcome


def reload_all(worker: Worker) -> list[ChangeOutcome]:
    """Reload every pipeline read from a file (SIGHUP); a refused spec changes nothing.

    Each failure is logged (``serving.reload_failed``) and the others go on.
    """
    outcomes = []
    for name in list(worker.pipelines):
        try:
            outcomes.append(reload(worker, name))
        except ValueError as err:  # ConfigError included: a spec file that is bad now
            log.warning("serving.reload_failed", pipeline=name, error=str(err))
        except Exception as err:  # logged; SIGHUP has no one else to answer
            log.error("serving.reload_failed", pipeline=name, error=f"{type(err).__name__}: {err}")
    return outcomes


def swap(worker: Worker, old: ServedPipeline, spec: PipelineSpec, path: Path) -> ChangeOutcome:
    """Replace ``old`` by the pipeline of ``spec`` (call with ``worker.changing`` held).

    Raises:
        AdmissionRefused: admission refused the new spec for another reason than memory;
            nothing changed.
        RestoreFailed: the new pipeline failed, and so did loading the old one again.
    """
    started = time.perf_counter()
    new = worker.build(spec)
    try:
        new.admit()  # beside the old one: its pinned components count
        overlapped = True
    except AdmissionRefused as refused:
        if not set(refused.codes) <= MEMORY_CODES:
            new.close()
            raise
        overlapped = False
    kept = _shared_with(old.orchestrator, new)
    if overlapped:
        outcome = _swap_beside(worker, old, new, path)
    else:
        outcome = _swap_after(worker, old, new, path)
    if not outcome.restored:
        served = worker.resolve(spec.name)
        swapped = PipelineSwapped(
            pipeline=spec.name,
            path=str(path),
            overlapped=overlapped,
            kept=kept,
            duration_ms=round((time.perf_counter() - started) * 1e3, 3),
        )
        log.info("pipeline.swapped", **msgspec.structs.asdict(swapped))
        served.orchestrator.announce(swapped)
    return msgspec.structs.replace(outcome, overlapped=overlapped, kept=kept)


def _swap_beside(
    worker: Worker, old: ServedPipeline, new: Orchestrator, path: Path
) -> ChangeOutcome:
    """Load ``new`` while ``old`` serves, hand its name over, then retire ``old``."""
    try:
        served = worker.serve(new, path)
    except Exception as err:  # the old one never stopped serving
        new.close()
        return _restored_outcome(old, path, err)
    old.orchestrator.begin_swap()
    old.gate.close(SWAPPING)
    worker.put(served)
    old.gate.wake_waiters()  # they go on with the new one
    worker.retire(old)
    return ChangeOutcome(name=served.name, action="swapped")


def _swap_after(
    worker: Worker, old: ServedPipeline, new: Orchestrator, path: Path
) -> ChangeOutcome:
    """Drain ``old``, release what ``new`` does not share, then load ``new`` (or ``old`` again)."""
    old.orchestrator.begin_swap()
    old.gate.close(SWAPPING)
    try:
        old.batcher.drain(old.settings.drain_timeout)
        old.orchestrator.drain()
        try:
            old.orchestrator.release_unshared(set(new.identities().values()))
            new.admit()  # again: the old one's pinned components no longer count
            served = worker.serve(new, path)
        except Exception as err:
            new.close()
            _serve_again(worker, old)
            return _restored_outcome(old, path, err)
        worker.put(served)
        worker.retire(old)
        return ChangeOutcome(name=served.name, action="swapped")
    finally:
        old.gate.wake_waiters()


def _serve_again(worker: Worker, old: ServedPipeline) -> None:
    """Load ``old``'s spec again on a fresh orchestrator (sharing what ``old`` still holds),
    list it, and release ``old``.

    Raises:
        RestoreFailed: it could not be loaded; the pipeline is no longer served.
    """
    again = worker.build(old.spec)
    try:
        served = worker.serve(again, old.path)
    except Exception as err:
        again.close()
        worker.drop(old)
        worker.retire(old)
        log.error("serving.restore_failed", pipeline=old.name, error=f"{type(err).__name__}: {err}")
        raise RestoreFailed(
            f"pipeline '{old.name}' could not be loaded again after its swap failed "
            f"({type(err).__name__}: {err}); it is no longer served"
        ) from err
    worker.put(served)
    worker.retire(old)


def _restored_outcome(old: ServedPipeline, path: Path, err: Exception) -> ChangeOutcome:
    """Say (log, event) that a swap failed and the old pipeline serves; return the outcome."""
    cause = f"{type(err).__name__}: {err}"
    restored = PipelineRestored(pipeline=old.name, path=str(path), cause=cause)
    log.warning("pipeline.restored", **msgspec.structs.asdict(restored))
    old.orchestrator.announce(restored)
    return ChangeOutcome(name=old.name, action="swapped", restored=True, cause=cause)


def _shared_with(old: Orchestrator, new: Orchestrator) -> tuple[str, ...]:
    """Return the new pipeline's components equal to one of the old one's (kept across)."""
    try:
        ours = new.identities()
        theirs = set(old.identities().values())
    except (OSError, ValueError):  # an unreadable weights file: nothing is kept, its load says why
        return ()
    return tuple(sorted(name for name, identity in ours.items() if identity in theirs))


def _reloaded(orchestrator: Orchestrator, path: Path, outcome: ReloadOutcome) -> None:
    """Say (log, event) how re-reading a pipeline's spec ended."""
    event = PipelineReloaded(pipeline=orchestrator.spec.name, path=str(path), outcome=outcome)
    log.info("pipeline.reloaded", **msgspec.structs.asdict(event))
    orchestrator.announce(event)


@contextmanager
def _closed_on_failure(orchestrator: Orchestrator) -> Iterator[None]:
    """Close ``orchestrator`` if what runs inside raises (a pipeline that never served)."""
    try:
        yield
    except BaseException:
        orchestrator.close()
        raise

"""Stop signals during a run: the first asks to stop, a second abandons, cleanup is spared."""

from __future__ import annotations

import signal

import pytest

from lifecycle.cli.signals import Abandoned, StopOnSignal


class TestStopOnSignal:
    def test_first_signal_asks_to_stop(self) -> None:
        """The first SIGTERM is noted; the run is asked to stop and exits 143."""
        with StopOnSignal() as stop:
            assert not stop.should_stop()
            signal.raise_signal(signal.SIGTERM)
            assert stop.should_stop()
        assert (stop.received, stop.exit_code) == (signal.SIGTERM, 143)

    def test_second_signal_abandons(self) -> None:
        """A second signal raises ``Abandoned``, which no ``except Exception`` swallows."""
        with StopOnSignal() as stop:
            signal.raise_signal(signal.SIGINT)
            with pytest.raises(Abandoned):
                signal.raise_signal(signal.SIGINT)
        assert stop.exit_code == 130
        assert not issubclass(Abandoned, Exception)

    def test_after_settle_signals_are_only_noted(self) -> None:
        """Once cleanup starts, further signals neither abandon nor change the first one."""
        with StopOnSignal() as stop:
            signal.raise_signal(signal.SIGINT)
            stop.settle()
            signal.raise_signal(signal.SIGTERM)
        assert stop.received is signal.SIGINT

    def test_handlers_are_restored(self) -> None:
        """Leaving the block puts the previous handlers back."""
        before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        with StopOnSignal():
            assert signal.getsignal(signal.SIGTERM) != before[signal.SIGTERM]
        assert {s: signal.getsignal(s) for s in before} == before

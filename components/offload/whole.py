"""A store that moves a whole module as one group: the common body of host and disk offload."""

from __future__ import annotations

from components.offload.base import Group, WeightStore

__all__ = ["WholeStore"]


class WholeStore(WeightStore):
    """Offload a whole module as one :class:`Group`; the target is the group's.

    Subclasses build the group (resident or offloaded) in ``__init__`` and
    drop what their target keeps in ``close()``.
    """

    _group: Group

    @property
    def is_resident(self) -> bool:
        """Whether the module's weights are usable on the compute device."""
        return self._group.is_resident

    def prefetch(self) -> int:
        """Start the onload early; return the bytes it will hold (0 if nothing started).

        The bytes are not counted by ``resident_bytes()`` until ``onload()``
        completes it: reserve them meanwhile.
        """
        self._check_open()
        return self._group.prefetch()

    def onload(self) -> int:
        """Make the weights usable on the device; return the bytes moved.

        Raises:
            OffloadError: the weights could not be brought back; the module stays offloaded.
        """
        self._check_open()
        return self._group.onload()

    def offload(self) -> int:
        """Take the weights off the device; return the bytes freed.

        Raises:
            OffloadError: the target could not take them; nothing is freed.
        """
        self._check_open()
        return self._group.offload()

    def resident_bytes(self) -> int:
        """Return the module's accounted bytes while resident, else 0."""
        return self.nbytes if self._group.is_resident else 0

    def close(self) -> None:
        """Drop the host copies (a subclass drops its target's files first)."""
        if not self._is_closed:
            self._group.close()
            self._is_closed = True

"""The device and what lives on it: moves, the shared device, a pipeline's life there,
budget, waiting, priorities, slots, sharing and the request timeline.

``moves`` holds the guards and the work of onload, offload and release; ``shared`` the
device several pipelines share (one lock, one budget, one line of waiters), which owns
what it knows of them and of their requests; ``pipeline_life`` a pipeline's own life
there (sleep, wake, swap, drain, release); ``budget`` what each component holds and
whom an onload evicts; ``waiting`` and ``priorities`` the requests waiting for memory
and their order; ``slots`` the record of one component while it lives; ``sharing``
when two pipelines hold one component; ``timeline`` the declared order of stages.
"""

__all__: list[str] = []

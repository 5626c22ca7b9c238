"""The device and what lives on it: moves, the shared device, budget, waiting, priorities,
slots, sharing and the request timeline.

``moves`` holds the guards and the work of onload, offload and release; ``shared`` the
device several pipelines share (one lock, one budget, one line of waiters);
``budget`` what each component holds and whom an onload evicts; ``waiting`` and
``priorities`` the requests waiting for memory and their order; ``slots`` the record
of one component while it lives; ``sharing`` when two pipelines hold one component;
``timeline`` the declared order of stages.
"""

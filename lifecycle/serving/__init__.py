"""``lifecycle serve``: an HTTP worker around one orchestrator (design §5.5, §10).

The HTTP layer (FastAPI, uvicorn, prometheus-client) is the optional ``serve`` extra:
importing this package needs none of it; ``lifecycle.serving.app`` does.
"""

__all__: list[str] = []

"""`specee serve`: an OpenAI-compatible HTTP server on the engine thread (FastAPI + uvicorn, the
`specee[server]` extra). `create_app` builds the ASGI app; `specee.cli.serve` runs it."""
from .app import create_app

__all__ = ["create_app"]

"""OpenAI-compatible HTTP server over :class:`~sparsecompile.serving.engine.LLMEngine`.

``create_app(engine, served_model_name, config)`` builds the FastAPI app; ``serve(engine, config)`` runs it with
uvicorn (``sparsecompile serve`` on the command line). Options: :class:`sparsecompile.config.ServerConfig`.
"""

from __future__ import annotations

from .app import create_app
from .async_engine import AsyncEngine, EngineDeadError, RequestStream
from .metrics import ServerMetrics
from .runner import serve

__all__ = ["AsyncEngine", "EngineDeadError", "RequestStream", "ServerMetrics", "create_app", "serve"]

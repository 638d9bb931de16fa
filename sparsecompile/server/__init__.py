"""OpenAI-compatible HTTP server over :class:`~sparsecompile.serving.engine.LLMEngine`.

``create_app(engine, served_model_name)`` builds the FastAPI app; ``serve(...)`` runs it with uvicorn
(``sparsecompile serve`` on the command line).
"""

from __future__ import annotations

from .app import create_app, serve
from .async_engine import AsyncEngine, EngineDeadError, RequestStream
from .metrics import ServerMetrics

__all__ = ["AsyncEngine", "EngineDeadError", "RequestStream", "ServerMetrics", "create_app", "serve"]

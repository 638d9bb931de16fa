"""FX / dynamo graph passes: check that attention was captured, and rewrite SDPA where it was not."""

from .capture import CaptureError, capture_backend, count_attention_sites

__all__ = ["CaptureError", "capture_backend", "count_attention_sites"]

"""The serving layer (floor 4): continuous batching over a patched model.

``engine.py`` (LLMEngine: the step loop), ``scheduler.py`` (admission, chunked prefill, preemption; model-free;
what it schedules in ``request.py``), ``sampling.py``, ``logprobs.py``, ``detokenizer.py``, ``outputs.py``
(SamplingParams, RequestOutput) and ``interface.py`` (the :class:`Engine` protocol the server depends on). It drives
the KV core through the patched model's SparseController and imports nothing above it. (Import the modules
themselves: this package file stays empty so that reading ``outputs`` does not load torch.)
"""

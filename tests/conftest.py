"""Shared fixtures. Triton kernels run in interpreter mode on machines without CUDA."""

from __future__ import annotations

import os
import sys

# Inductor's CPU kernels as scalar C++ (no at::vec): the suite's compiled graphs are tiny models, whose compiles
# (g++ over the vector headers, the scheduler's vectorization checks) are a sixth of its time on the 2-core CI
# machine; a 2-layer decode graph took 21.6 s instead of 34.7. What the tests check, one graph, no breaks, no
# recompiles, compiled tokens equal to eager, no pool-sized buffers in the generated code, does not depend on
# vectorization. Read when inductor's config is imported, so set before torch.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before any @triton.jit kernel is defined
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402

# Under pytest-xdist (the README's test command: one worker per core) each worker computes on its share of the
# cores. Two workers of two threads each on the 2-core CI machine doubled the suite's CPU time (OpenMP spin-waits).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, torch.get_num_threads()) // _WORKERS))


def _weight(item: pytest.Item) -> int:
    """0: a module whose every test is slow (the embedded SmolLM2's long prompts), 1: a slow test, 2: the rest."""
    marks = getattr(item.module, "pytestmark", [])
    marks = marks if isinstance(marks, list) else [marks]
    if any(getattr(m, "name", None) == "slow" for m in marks):
        return 0
    return 1 if item.get_closest_marker("slow") is not None else 2


def pytest_collection_modifyitems(config, items):
    """The slowest modules first: pytest-xdist hands whole modules to its workers in the order their first test
    comes (``--dist loadfile``), so the long ones start early and the short ones fill the end."""
    items.sort(key=_weight)


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model (downloaded and converted once per cache dir), fp32 on CPU."""
    from sparsecompile.models.default_model import load_model

    model, tokenizer = load_model(None, dtype=torch.float32, device="cpu")
    return model, tokenizer


@pytest.fixture(scope="session")
def smollm2_path():
    from sparsecompile.models.default_model import resolve_model_path

    return resolve_model_path(None)


@pytest.fixture
def sparsecompile_log(caplog):
    """``caplog`` with sparsecompile's WARNING records, its handler attached to the ``sparsecompile`` logger itself:
    that logger does not propagate to the root logger (``runtime/compilation.py``), where caplog listens, and a
    clean CI run once missed a warning that way (2739be2)."""
    import logging

    logger = logging.getLogger("sparsecompile")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="sparsecompile"):  # whatever level an earlier test left
            yield caplog
    finally:
        logger.removeHandler(caplog.handler)

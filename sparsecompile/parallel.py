"""``LLM(..., tensor_parallel_size=N)``: start (or join) the N ranks that serve one model.

Two ways in, one code path after the process group exists:

* **spawned** (a plain ``python`` process): this process becomes rank 0. It hosts the rendezvous store,
  starts ranks ``1..N-1`` with ``torch.multiprocessing`` (spawn; rank ``r`` uses ``cuda:r``) and waits until
  each has connected (a worker that dies first is reported with its exit code, not waited for);
* **torchrun** (``RANK`` / ``WORLD_SIZE`` set, or a process group already initialized): every rank of the job
  runs ``LLM(...)``; rank 0 returns a driving ``LLM``, the others serve rank 0's calls inside the constructor
  until rank 0 closes its ``LLM``, then return one with ``is_driver == False``. Multi-node jobs are the same
  code under torchrun's rendezvous.

Each rank then builds its replica (:class:`Replica`: load on CPU, ``optimize(..., tp_size=N)`` shards it and
moves the shard to the rank's device) and rank 0 installs the :class:`~sparsecompile.serving.tp_worker.Driver`
before the engine is built, so the engine's pool, admissions and evictions are decided once and replayed.
"""

from __future__ import annotations

import atexit
import datetime
import os
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .methods.registry import fill_text_options
from .models.hf_patch import patched_model
from .models.support import decoder_config, inspect_model
from .models.tensor_parallel import check_head_split
from .optimize import optimize
from .runtime import distributed
from .runtime.distributed import TensorParallelError
from .serving.tp_worker import Driver, serve_calls

_READY_KEY = "sparsecompile/tp_ready/rank{}"
_SPAWNED: weakref.ref | None = None  # the spawned-mode run this process drives (one at a time)


@dataclass
class Replica:
    """How every rank builds its shard of the model: load (a path: on CPU) and optimize with ``tp_size``."""

    source: Any  # an nn.Module, a path, or None (the embedded default model)
    method: str
    options: dict  # engine and method options, tp_size included
    dtype: torch.dtype | None = None
    cuda: bool = False  # the shards live on GPUs (NCCL) rather than the CPU (gloo)

    def build(self) -> tuple[nn.Module, Any]:
        tokenizer = None
        if isinstance(self.source, nn.Module):
            model = self.source
        else:
            from .models.default_model import load_model

            dtype = self.dtype or (torch.bfloat16 if self.cuda else torch.float32)
            model, tokenizer = load_model(self.source, dtype=dtype, device="cpu")  # optimize moves the shard
        options = dict(self.options)
        fill_text_options(self.method, options, tokenizer)  # every rank loaded the same tokenizer: the same ids
        optimize(model, self.method, **options)
        return model, tokenizer


@dataclass(eq=False)
class TensorParallelRun:
    """This process's part of a tensor-parallel LLM: the model and driver on rank 0, nothing on a worker."""

    session: distributed.Session
    model: nn.Module | None = None
    tokenizer: Any = None
    driver: Driver | None = None
    workers: Any = None  # the spawned workers' ProcessContext (spawned mode, rank 0)
    closed: bool = False

    @property
    def is_driver(self) -> bool:
        return self.driver is not None

    def close(self, timeout: float = 30.0) -> None:
        """Stop the workers (rank 0); in spawned mode also leave and destroy the process group."""
        if self.closed:
            return
        self.closed = True
        if self.driver is not None:
            self.driver.close()
        if self.workers is not None:
            _join(self.workers, timeout)
            _release(self.workers, self.session)


def launch(source: Any, method: str, options: dict, size: int, *, dtype: torch.dtype | None = None,
           device: str | None = None) -> TensorParallelRun:
    """Start or join the ``size`` ranks of one LLM (see module docstring); ``options``: engine + method options.

    Spawned ranks run on GPUs (NCCL) when ``device`` is CUDA, or when it is None and the model object is on a GPU
    (a path: when CUDA is available); on the CPU (gloo) otherwise. Under torchrun: GPUs whenever CUDA is available.
    """
    options = {**options, "tp_size": size}
    timeout = float(options.get("tp_timeout", 600.0))
    import torch.distributed as dist

    active = _SPAWNED() if _SPAWNED is not None else None
    if active is not None and not active.closed:
        raise RuntimeError("this process already drives a tensor-parallel LLM with spawned workers: close() it first")
    if dist.is_initialized() or "RANK" in os.environ:
        cuda = torch.cuda.is_available()
        run = _build(Replica(source, method, options, dtype, cuda), None, size)
        if run.is_driver:
            return run
        serve_calls(patched_model(run.model), run.session)  # until rank 0 closes its LLM
        return TensorParallelRun(run.session)
    if device is not None:  # where the ranks run (a CPU model object is split, then each shard moves to its GPU)
        cuda = str(device).startswith("cuda")
    elif isinstance(source, nn.Module):
        cuda = next(source.parameters()).device.type == "cuda"
    else:
        cuda = torch.cuda.is_available()
    if cuda and torch.cuda.device_count() < size:
        raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs; this machine has "
                         f"{torch.cuda.device_count()}")
    _check_heads_before_spawning(source, size)
    replica = Replica(source, method, options, dtype, cuda)
    workers = _spawn(replica, size, timeout, "nccl" if cuda else "gloo")
    return _build(replica, workers, size)


def _check_heads_before_spawning(source: Any, size: int) -> None:
    """Refuse a ``size`` that cannot split the heads before starting workers (each would load the model first): a
    model object, or a local HF directory's config; anything else is checked by every rank."""
    if isinstance(source, nn.Module):
        info = inspect_model(source)
        check_head_split(info.model_type, info.num_q_heads, info.num_kv_heads, size)
        return
    if source is None or not (Path(source) / "config.json").is_file():
        return
    from transformers import AutoConfig

    config = decoder_config(AutoConfig.from_pretrained(source, local_files_only=True))
    q_heads = getattr(config, "num_attention_heads", None)
    if isinstance(q_heads, int):
        kv_heads = getattr(config, "num_key_value_heads", None) or q_heads
        check_head_split(getattr(config, "model_type", "model"), q_heads, kv_heads, size)


def _build(replica: Replica, workers: Any, size: int) -> TensorParallelRun:
    """Build this rank's replica inside the failure guard; rank 0 gets the driver."""
    if workers is None:
        distributed.join(size, float(replica.options.get("tp_timeout", 600.0)))
    session = distributed.current()
    run = TensorParallelRun(session, workers=workers)
    if workers is not None:
        global _SPAWNED
        session.peer_checks.append(lambda: _dead_worker(workers))
        session.on_failure.append(lambda: _stop(workers))
        weakref.finalize(run, _release, workers, session)  # an LLM dropped without close()
        _SPAWNED = weakref.ref(run)
    try:
        model, tokenizer = session.guarded(replica.build)
    except BaseException:
        if workers is not None:
            _release(workers, session)
        raise
    if session.group.rank == 0:
        run.model, run.tokenizer = model, tokenizer
        run.driver = Driver(patched_model(model), session)
        atexit.register(_close_at_exit, weakref.ref(run))  # the workers stop when this process ends
    else:
        run.model = model
    return run


def _close_at_exit(ref: weakref.ref) -> None:
    run = ref()
    if run is not None:
        run.close(timeout=10.0)


# ---------------------------------------------------------------------------------------------------- spawning
def _spawn(replica: Replica, size: int, timeout: float, backend: str) -> Any:
    """Start ranks 1..size-1, wait until each reached the rendezvous, then join as rank 0."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    host = "127.0.0.1"
    store = dist.TCPStore(host, 0, size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    workers = mp.start_processes(_worker, args=(size, host, store.port, replica, timeout, backend),
                                 nprocs=size - 1, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    waiting = set(range(1, size))
    while waiting:
        waiting = {r for r in waiting if not store.check([_READY_KEY.format(r)])}
        dead = _dead_worker(workers)
        if dead is not None:
            _stop(workers)
            raise TensorParallelError(f"a tensor-parallel worker failed while starting: {dead}")
        if time.monotonic() > deadline:
            _stop(workers)
            raise TensorParallelError(f"tensor-parallel workers {sorted(waiting)} did not start within {timeout} s")
        time.sleep(0.05)
    try:
        distributed.init_process_group(store, 0, size, backend, timeout)
        distributed.start_session(size, owns_process_group=True, timeout=timeout)
    except BaseException:
        _stop(workers)
        raise
    return workers


def _worker(index: int, size: int, host: str, port: int, replica: Replica, timeout: float, backend: str) -> None:
    """Entry point of spawned rank ``index + 1``: join, build the replica, serve rank 0's calls."""
    import torch.distributed as dist

    rank = index + 1
    store = dist.TCPStore(host, port, size, is_master=False, timeout=datetime.timedelta(seconds=timeout))
    store.set(_READY_KEY.format(rank), "1")
    distributed.init_process_group(store, rank, size, backend, timeout)
    session = distributed.start_session(size, owns_process_group=True, timeout=timeout)
    model, _ = session.guarded(replica.build)
    serve_calls(patched_model(model), session)
    distributed.shutdown()


def _dead_worker(workers: Any) -> str | None:
    for i, process in enumerate(workers.processes):
        if process.exitcode is not None and process.exitcode != 0:
            return f"worker rank {i + 1} exited with code {process.exitcode} (its traceback is above)"
    return None


def _join(workers: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for process in workers.processes:
        process.join(max(0.0, deadline - time.monotonic()))
    _stop(workers)


def _release(workers: Any, session: distributed.Session) -> None:
    _stop(workers)
    if distributed.current() is session:
        distributed.shutdown()


def _stop(workers: Any) -> None:
    """Terminate workers still running (after a failure, or when rank 0 goes away)."""
    for process in workers.processes:
        if process.is_alive():
            process.terminate()
    for process in workers.processes:
        process.join(5.0)
        if process.is_alive():
            process.kill()
            process.join(5.0)

"""Tensor parallelism in the KV core: the process group attention heads are split over, the collectives a
method may use, and how one rank's failure stops every rank.

Every rank holds ``1 / size`` of the query and KV heads (``models/tensor_parallel.py`` shards the weights),
so its :class:`~sparsecompile.runtime.controller.SparseController`, ``CacheManager``, pool and method state
cover only its KV heads. Per-KV-head decisions (SnapKV, PyramidKV, H2O, StreamingLLM, Quest) are local. A
decision that reduces over *all* heads (OmniKV's max over query heads) combines the per-rank partial result
with :meth:`TPGroup.all_reduce` before it selects, so every rank selects the same set: methods reach the group
as ``self.model.tp`` (:class:`~sparsecompile.runtime.model_info.ModelInfo`), which is :data:`SINGLE` (a
no-op) without tensor parallelism. The collectives are ``torch.ops._c10d_functional`` ops: they run eagerly
and trace into the compiled (CUDA-graph) decode step.

Host-side decisions (pool sizes, admissions, page allocation, evictions' slot counts) follow from the same
inputs on every rank. Under ``torchrun`` + ``generate()`` each rank runs the same loop; in the serving engine
rank 0 decides and the workers replay its controller calls (``serving/tp_worker.py``).

Failure (a rank raising inside a controller call; see :class:`DistributedController`):

* the failing rank writes ``"rank r: <error>"`` to the rendezvous store (:class:`FailureBoard`), runs the
  session's failure hooks (the serving driver stops its workers), leaves the process group (its peers'
  pending collectives then fail at once on gloo) and re-raises its own error;
* a rank whose call fails because a peer failed raises :class:`TensorParallelError` with the peer's reason;
* a rank stuck in a collective (NCCL, CUDA-graph replays) is freed by :class:`Watchdog`, which polls the
  store: it aborts the process group and, if the rank is still stuck ``tp_timeout`` seconds later, ends the
  process with the reason rather than hang. Eager collectives also time out after ``tp_timeout``.
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

_FAILURE_KEY = "sparsecompile/tp_failure/rank{}"
_CONTROL_TIMEOUT = datetime.timedelta(days=7)  # an idle serving worker waits this long for rank 0's next call


class TensorParallelError(RuntimeError):
    """A rank of the tensor-parallel group failed; the message names the rank and its error."""


@dataclass(frozen=True)
class TPGroup:
    """The ranks the attention heads are split over (``size == 1``: no tensor parallelism, every call a no-op).

    ``name`` is the c10d name of the process group, so the collectives below trace into compiled graphs.
    """

    rank: int = 0
    size: int = 1
    name: str = ""

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """``tensor`` reduced elementwise over the ranks (``op``: "sum", "max", "min", ...); the same on every rank."""
        if self.size == 1:
            return tensor
        out = torch.ops._c10d_functional.all_reduce(tensor.contiguous(), op, self.name)
        return torch.ops._c10d_functional.wait_tensor(out)

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' ``tensor`` concatenated along ``dim`` in rank order (same shape on every rank)."""
        if self.size == 1:
            return tensor
        out = torch.ops._c10d_functional.all_gather_into_tensor(tensor.contiguous(), self.size, self.name)
        out = torch.ops._c10d_functional.wait_tensor(out)
        return torch.cat(out.chunk(self.size, dim=0), dim=dim)


SINGLE = TPGroup()


# ---------------------------------------------------------------------------------------------------- failures
class FailureBoard:
    """Failure reasons in the rendezvous store, one key per rank, so a rank that sees a collective fail can name
    the rank that caused it."""

    def __init__(self, store: Any, rank: int, size: int, patience: int = 3) -> None:
        self.store, self.rank, self.size = store, rank, size
        self.patience, self._misses = patience, 0  # consecutive unreachable checks before the store counts as lost

    def publish(self, reason: str) -> None:
        try:
            self.store.set(_FAILURE_KEY.format(self.rank), reason)
        except Exception:  # the store is gone with its host: the peers learn of the failure from their sockets
            pass

    def peer_failure(self) -> str | None:
        """The first other rank's published reason, or a reason once the store has been unreachable ``patience``
        times in a row (its host is gone)."""
        try:
            for r in range(self.size):
                key = _FAILURE_KEY.format(r)
                if r != self.rank and self.store.check([key]):
                    return self.store.get(key).decode()
        except Exception as err:
            self._misses += 1
            if self._misses >= self.patience:
                return f"lost contact with the rendezvous store ({type(err).__name__}: {err})"
            return None
        self._misses = 0
        return None


class Watchdog(threading.Thread):
    """Polls the board while this rank lives. When a peer failed while this rank is inside a step, it aborts the
    process group (NCCL: collectives in flight, graph-replayed ones included, return with an error); a rank still
    stuck ``grace`` seconds later (the ``tp_timeout``) ends its process with the reason rather than hang."""

    def __init__(self, session: Session, grace: float, poll: float = 0.5) -> None:
        super().__init__(name="sparsecompile-tp-watchdog", daemon=True)
        self.session, self.poll, self.grace = session, poll, grace
        self.stopped = threading.Event()

    def stop(self) -> None:
        """Stop polling and wait for the thread, so that it is never inside a store call while the process group
        (or the interpreter, at exit) tears the store down."""
        self.stopped.set()
        atexit.unregister(self.stop)
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout=10 * self.poll)

    def run(self) -> None:
        s = self.session
        noticed: float | None = None
        while not self.stopped.wait(self.poll):
            reason = s.failed or s.board.peer_failure() or s.check_peers()
            if reason is None:
                continue
            s.failed = s.failed or reason
            if s.busy_since is None:
                noticed = None  # idle: the next call raises; nothing to unblock
                continue
            if noticed is None:
                noticed = time.monotonic()
                _abort_process_groups()  # NCCL: in-flight collectives return with an error
            elif time.monotonic() - noticed > self.grace:  # the tp_timeout, for collectives replayed in graphs
                print(f"sparsecompile: tensor-parallel rank {s.group.rank} is still stuck {self.grace:.0f} s after "
                      f"a peer failed; stopping the process. {s.failed}", file=sys.stderr, flush=True)
                os._exit(1)


def _abort_process_groups() -> None:
    import torch.distributed as dist

    try:
        if dist.is_initialized() and dist.get_backend() == "nccl":
            dist.distributed_c10d._abort_process_group()
    except Exception:
        pass


# ---------------------------------------------------------------------------------------------------- session
@dataclass(eq=False)
class Session:
    """This process's membership in the tensor-parallel group (one per process; see :func:`join`)."""

    group: TPGroup
    backend: str
    control: Any  # a gloo ProcessGroup for host messages (serving: rank 0's calls), with a long timeout
    board: FailureBoard
    owns_process_group: bool
    failed: str | None = None
    busy_since: float | None = None
    on_failure: list[Callable[[], None]] = field(default_factory=list)
    peer_checks: list[Callable[[], str | None]] = field(default_factory=list)
    watchdog: Watchdog | None = None

    @property
    def device(self) -> torch.device:
        """Where this rank's shard of the model and its KV pool live."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def check_peers(self) -> str | None:
        for check in self.peer_checks:
            reason = check()
            if reason:
                return reason
        return None

    def guarded(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one replicated step of work; on failure stop the group (see the module docstring)."""
        if self.failed:  # a peer failed while this rank was idle (the watchdog noticed): stop here too
            self.stop()
            raise TensorParallelError(f"the tensor-parallel group stopped: {self.failed}")
        self.busy_since = time.monotonic()
        try:
            return fn(*args, **kwargs)
        except BaseException as err:
            peer = self.board.peer_failure() or self.check_peers()
            if peer is not None or isinstance(err, TensorParallelError):
                self.failed = self.failed or peer or str(err)
                self.stop()
                if isinstance(err, TensorParallelError):
                    raise
                raise TensorParallelError(f"the tensor-parallel group stopped: {self.failed}") from err
            self.fail(f"rank {self.group.rank}: {type(err).__name__}: {err}")
            raise
        finally:
            self.busy_since = None

    def fail(self, reason: str) -> None:
        """This rank failed: publish the reason, then :meth:`stop`."""
        if self.failed is None:
            self.failed = reason
            self.board.publish(reason)
        self.stop()

    def stop(self) -> None:
        """Run the failure hooks once (the serving driver stops its workers) and leave the group."""
        hooks, self.on_failure = self.on_failure, []
        for hook in hooks:
            try:
                hook()
            except Exception:
                pass
        self.leave()

    def leave(self) -> None:
        """Leave the process group (peers blocked in a collective with this rank get an error at once)."""
        global _SESSION
        import torch.distributed as dist

        if self.watchdog is not None:
            self.watchdog.stop()
        if _SESSION is not self:  # already left (a later session may own the process group now)
            return
        _SESSION = None
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


_SESSION: Session | None = None


def current() -> Session | None:
    return _SESSION


def join(size: int, timeout: float) -> TPGroup:
    """Join (or check) the ``size``-rank group this process belongs to; returns its :class:`TPGroup`.

    Uses an already initialized default process group (``torchrun`` scripts, ``LLM(tensor_parallel_size=N)``);
    otherwise initializes one from ``torchrun``'s environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` ...).
    NCCL when CUDA is available (this rank's device is ``cuda:LOCAL_RANK``), gloo otherwise.
    """
    import torch.distributed as dist

    if _SESSION is not None:
        if _SESSION.group.size != size:
            raise ValueError(f"this process is already rank {_SESSION.group.rank} of a {_SESSION.group.size}-rank "
                             f"tensor-parallel group; it cannot also join one of {size}")
        return _SESSION.group
    if not dist.is_available():
        raise RuntimeError("tp_size > 1 needs torch.distributed, which this torch build does not have")
    owns = False
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise RuntimeError(
                f"tp_size={size} needs one process per rank: start the script with `torchrun --nproc-per-node "
                f"{size} script.py` (it sets RANK, WORLD_SIZE, MASTER_ADDR), or use sparsecompile.LLM(..., "
                f"tensor_parallel_size={size}), which starts its own worker processes")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
        owns = True
    return start_session(size, owns, timeout).group


def init_process_group(store: Any, rank: int, size: int, backend: str, timeout: float,
                       device_index: int | None = None) -> None:
    """Initialize the default process group on ``store`` (the serving engine's own rendezvous)."""
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank if device_index is None else device_index)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout))


def start_session(size: int, owns_process_group: bool, timeout: float) -> Session:
    """Create this process's :class:`Session` over the initialized default process group."""
    global _SESSION
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    if world != size:
        raise ValueError(f"tp_size={size} but the process group has {world} ranks; every rank of the job must "
                         f"serve the one model (data-parallel replicas are not supported): run {size} processes")
    backend = str(dist.get_backend())
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"tensor parallelism runs on the nccl (CUDA) or gloo (CPU) backend, not {backend!r}")
    control = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
    group = TPGroup(rank, world, dist.group.WORLD.group_name)
    session = Session(group, backend, control, FailureBoard(dist.distributed_c10d._get_default_store(), rank, world),
                      owns_process_group)
    session.watchdog = Watchdog(session, grace=timeout)
    session.watchdog.start()
    atexit.register(session.watchdog.stop)  # before the interpreter frees the store under a polling thread
    _SESSION = session
    return session


def shutdown() -> None:
    """Leave the group cleanly (no failure): stop the watchdog; destroy the process group if we created it."""
    global _SESSION
    import torch.distributed as dist

    session = _SESSION
    if session is None:
        return
    _SESSION = None
    if session.watchdog is not None:
        session.watchdog.stop()
    if session.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------- controller
class DistributedController:
    """The controller as ``generate()`` and the serving engine see it under tensor parallelism.

    Every public method call made through it (``reserve``, ``add_sequences``, ``prefill``, ``decode``,
    ``release_rows``, ``build_pool``, ...; any new one too) runs inside :meth:`Session.guarded`; with ``send``
    (the serving driver, rank 0) the call is first sent to the workers, which replay it on their controllers,
    so all ranks apply the same state transition. Attributes and properties are the controller's own. After
    a failure, releasing rows still frees this rank's pages (cleanup), every other call raises.
    """

    _OWN = ("_controller", "_session", "_send")
    _CLEANUP = frozenset({"release_rows"})
    _UNREPLICATED = frozenset({"attend"})  # runs inside a forward that is itself replicated

    def __init__(self, controller: Any, session: Session,
                 send: Callable[[str, tuple, dict], None] | None = None) -> None:
        object.__setattr__(self, "_controller", controller)
        object.__setattr__(self, "_session", session)
        object.__setattr__(self, "_send", send)

    @property
    def local(self) -> Any:
        """The wrapped SparseController (this rank's)."""
        return self._controller

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._controller, name)
        if (name.startswith("_") or name in self._UNREPLICATED or not isinstance(value, types.MethodType)
                or value.__self__ is not self._controller):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            if self._session.failed and name in self._CLEANUP:
                return value(*args, **kwargs)
            return self._session.guarded(self._replicate, name, value, args, kwargs)

        return call

    def _replicate(self, name: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if self._send is not None:
            self._send(name, args, kwargs)
        return fn(*args, **kwargs)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._controller, name, value)

    def __repr__(self) -> str:
        return f"DistributedController(rank {self._session.group.rank} of {self._session.group.size})"

"""Shared by the tensor-parallel tests (CPU: test_tensor_parallel.py, CUDA: gpu/test_tp_cuda.py): a tiny model
with 4 KV heads, one compressing configuration per method, and helpers to run ranks as torchrun does."""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback

import torch

ARCH = dict(num_attention_heads=8, num_key_value_heads=4)  # 2 query heads per KV head; 2 KV heads per rank
ENGINE = dict(page_size=4, prefill_chunk_size=16)
# budgets below the prompt lengths, so every method selects or evicts (and the ranks must agree on what)
CASES = {
    "vanilla": {},
    "snapkv": {"budget": 14, "window": 4},
    "pyramidkv": {"budget": 14, "window": 4},
    "h2o": {"budget": 12},
    "streamingllm": {"budget": 12},
    "quest": {"budget": 8, "dense_layers": 0, "dense_below": 0},
    "omnikv": {"budget": 8, "filter_layers": "0", "dense_below": 0},
}
#: checked on CPU (test_tensor_parallel.py), not yet on two GPUs, whose test also checks the decode capture
CPU_CASES = {
    **CASES,
    "kvzip": {"budget": 12},  # global selection: one threshold over every rank's heads
    "kivi": {"bits": 4, "group_size": 4, "residual": 8},
    "snapkv+kivi": {"budget": 16, "window": 4, "bits": 4, "group_size": 4, "residual": 8},
    "h2o+kivi": {"budget": 16, "recent": 4, "bits": 4, "group_size": 4, "residual": 8},
    "streamingllm+kivi": {"budget": 16, "sinks": 1, "bits": 4, "group_size": 4, "residual": 8},
    "kvzip+kivi": {"budget": 16, "bits": 4, "group_size": 4, "residual": 8},
}
SERVING = dict(max_num_seqs=3, max_num_batched_tokens=24)
LLM_PROMPT_LENGTHS = (21, 40, 9)
MAX_NEW = 6


class Tokenizer:
    """Token ``t`` decodes to ``"<t> "`` (the tests pass token ids)."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(f"{t} " for t in ids)


def tiny(**arch):
    from tiny_models import tiny_pair

    return tiny_pair("llama", **{**ARCH, **arch})[1]


def generate_prompts() -> torch.Tensor:
    return torch.randint(3, 96, (2, 26), generator=torch.Generator().manual_seed(0))


def llm_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in LLM_PROMPT_LENGTHS]


def generate_tokens(method: str, tp: int, device: str = "cpu", **engine) -> list[list[int]]:
    import sparsecompile

    model = sparsecompile.optimize(tiny().to(device), method, tp_size=tp, **ENGINE, **engine, **CPU_CASES[method])
    ids = generate_prompts().to(next(model.parameters()).device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False)
    return out[:, ids.shape[1]:].tolist()


def llm_tokens(llm) -> list[list[int]]:
    from sparsecompile import SamplingParams

    outs = llm.generate(llm_prompts(), SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def make_llm(method: str, tp: int, device: str = "cpu", **engine):
    from sparsecompile import LLM

    return LLM(tiny().to(device), method, tokenizer=Tokenizer(), tensor_parallel_size=tp, **SERVING, **ENGINE,
               **engine, **CPU_CASES[method])


def fault_after(cls, hook: str, decode_steps: int, message: str) -> None:
    """Make ``cls.hook`` raise ``message`` in layer 1 of the ``decode_steps``-th decode step (mid-forward)."""
    original = getattr(cls, hook)
    seen = [0]

    def faulty(self, ctx, *args):
        if not ctx.step.is_prefill and ctx.layer == 1:
            seen[0] += 1
            if seen[0] == decode_steps:
                raise RuntimeError(message)
        return original(self, ctx, *args)

    setattr(cls, hook, faulty)


def as_torchrun_rank(rank: int, size: int, port: int) -> None:
    """The environment torchrun gives rank ``rank`` of a single-host job."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _logged_rank(rank: int, fn, port: int, out: str) -> None:
    """A spawned rank with its stdout / stderr in ``out.<rank>.log`` (pytest does not show a child's output)."""
    log = os.open(f"{out}.{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        fn(rank, port, out)
    except BaseException:  # torch.multiprocessing keeps the traceback for a join() that run_ranks does not make
        traceback.print_exc()
        sys.stderr.flush()
        raise


def _tail(path: str, chars: int = 3000) -> str:
    try:
        with open(path, errors="replace") as handle:
            return handle.read()[-chars:]
    except OSError:
        return "(no log)"


def run_ranks(fn, size: int, out: str, timeout: float, while_running=None):
    """Start ``fn(rank, port, out)`` in ``size`` spawned processes; call ``while_running()`` meanwhile; return its
    result and each rank's JSON file ``out.<rank>``. Fails if a rank hangs or exits with an error (with the tail of
    each rank's output)."""
    import torch.multiprocessing as mp

    context = mp.start_processes(_logged_rank, args=(fn, free_port(), out), nprocs=size, join=False,
                                 start_method="spawn")
    try:
        result = while_running() if while_running is not None else None
    finally:
        for process in context.processes:
            process.join(timeout)
        alive = [p for p in context.processes if p.is_alive()]
        for p in alive:
            p.kill()
    logs = "\n".join(f"--- rank {r} (exit code {p.exitcode}):\n{_tail(f'{out}.{r}.log')}"
                     for r, p in enumerate(context.processes))
    assert not alive, f"a rank hung\n{logs}"
    assert [p.exitcode for p in context.processes] == [0] * size, logs
    return result, [json.load(open(f"{out}.{rank}")) for rank in range(size)]

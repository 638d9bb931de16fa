"""LLMEngine: continuous batching over one patched model (the serving runtime's core, not thread-safe).

One implementation: the engine drives the very SparseController that ``optimize()`` installs (same
method runtime, CacheManager, ops and compiled decode step as ``model.generate()``); it only replaces
HF's generation loop with the :class:`Scheduler`'s. Each :meth:`step` runs one decode forward over
every request past its prompt (padded to a CUDA-graph batch size when decode is compiled) and one
forward per scheduled prompt chunk, samples, applies stop conditions, and frees the rows of finished,
aborted and preempted requests at once.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import torch
from torch import nn

from ..config import ServingConfig
from ..models.hf_patch import patched_model
from ..models.support import UnsupportedModelError
from ..runtime.compilation import allow_recompiles
from .detokenizer import Detokenizer
from .outputs import CompletionOutput, RequestMetrics, RequestOutput, RequestRejected, SamplingParams
from .sampling import make_generator, sample
from .scheduler import PrefillChunk, Request, Scheduler

_CPU_KV_MEMORY = 1 << 30  # default KV pool on CPU when kv_cache_memory is not given
_GPU_KV_FRACTION = 0.85  # of the memory free after loading, when kv_cache_memory is not given


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    free_pages: int
    total_pages: int
    num_preemptions: int
    prompt_tokens: int  # prompt tokens fed (recomputation included)
    generation_tokens: int
    steps: int


@dataclass
class _Live:
    """Engine-side state of one request next to its scheduling state."""

    request: Request
    detok: Detokenizer
    generator: torch.Generator | None
    reported: int = 0  # output tokens already reported (the rest is this step's delta)


class LLMEngine:
    """See module docstring. Built over a model patched by ``sparsecompile.optimize()`` (``sparsecompile.LLM``
    does both)."""

    def __init__(self, model: nn.Module, tokenizer, config: ServingConfig | None = None) -> None:
        try:
            patched = patched_model(model)
        except ValueError as err:
            raise UnsupportedModelError(f"the serving engine needs a model patched by sparsecompile.optimize(): "
                                        f"{err}") from None
        config = config or ServingConfig()
        self.config = config
        self.model, self.tokenizer, self.patched = model, tokenizer, patched
        self.controller = c = patched.controller
        self.method = c.runtime.name
        self.model_name = config.model_name or getattr(model.config, "_name_or_path", None) or "sparsecompile"
        limit = patched.max_length or 4096
        self.max_model_len = min(config.max_model_len or limit, limit)
        max_num_seqs = config.max_num_seqs
        chunk = c.prefill_chunk or self.max_model_len
        self.max_num_batched_tokens = config.max_num_batched_tokens or max(chunk, max_num_seqs)
        self.device = c.layout.device
        num_pages = c.config.num_pages or self._pages_from_memory(config, max_num_seqs)
        widest = math.ceil((self.max_model_len + 1) / c.layout.page_size)
        self.manager = c.build_pool(num_pages, max_num_seqs + 1, widest)  # +1: the decode padding row
        self.scheduler = Scheduler(c.oracle, num_pages, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=self.max_num_batched_tokens, prefill_chunk_size=chunk,
                                   prefill_mode=c.runtime.prefill_mode, max_model_len=self.max_model_len)
        sizes = config.cuda_graph_sizes or [1 << i for i in range(max_num_seqs.bit_length())]
        self.graph_sizes = sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})
        if c.compiles_decode:
            allow_recompiles(2 * len(self.graph_sizes) + 8)
        self.eos_token_ids = _eos_ids(model, tokenizer)
        self._live: dict[str, _Live] = {}
        self._aborted: list[RequestOutput] = []
        self._counters = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}
        self._default_seeds = 0  # requests seeded from config.seed so far

    def _pages_from_memory(self, config: ServingConfig, max_num_seqs: int) -> int:
        """Pages that fit the KV memory budget, capped by what ``max_num_seqs`` full-length requests could use."""
        c = self.controller
        probe = c.build_pool(1, 1, 1)  # registers the method's metadata, so its bytes count per page
        per_page = probe.bytes_per_page
        budget = kv_budget_bytes(config, self.device)
        useful = max_num_seqs * c.oracle.pages_for(c.oracle.peak_slots_per_layer(self.max_model_len, 0))
        pages = min(budget // per_page, useful)
        if pages < c.layout.num_layers:
            raise ValueError(f"kv_cache_memory={budget} bytes holds {budget // per_page} pages of {per_page} bytes; "
                             f"one token needs {c.layout.num_layers} (one per layer): give the engine more memory")
        return pages

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None, *,
                    prompt_text: str | None = None) -> None:
        """Queue a request; :class:`RequestRejected` (with the reason) when it can never be served.

        ``prompt_text``: with token ids, the text they came from (a rendered chat), reported as the output's
        ``prompt``. A request without a seed gets the next default seed when ``ServingConfig.seed`` is set.
        """
        params = params or SamplingParams()
        if request_id in self._live:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer(prompt).input_ids
        else:
            text, ids = prompt_text, list(prompt)
        vocab = self.model.get_input_embeddings().num_embeddings
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise RequestRejected(f"prompt token ids must be integers in [0, {vocab})")
        params.validate()
        if params.seed is None and self.config.seed is not None:
            params = replace(params, seed=self.config.seed + self._default_seeds)
            self._default_seeds += 1
        request = Request(request_id, ids, params, RequestMetrics(time.monotonic(), num_prompt_tokens=len(ids)),
                          prompt=text)
        self.scheduler.add(request)
        self._live[request_id] = _Live(request, Detokenizer(self.tokenizer, params, self.eos_token_ids),
                                       make_generator(params.seed, self.device))

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation rendered by the tokenizer's chat template, the assistant's turn opened."""
        return self.chat_prompt(messages)[1]

    def chat_prompt(self, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
        """A conversation rendered by the tokenizer's chat template (the assistant's turn opened), and its ids.

        Tokenized without adding special tokens again: the template already holds the ones the model expects.
        """
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise RequestRejected("the tokenizer has no chat template; send a raw prompt (/v1/completions) instead")
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        return text, self.tokenizer(text, add_special_tokens=False).input_ids

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its pages (unknown or finished ids are ignored)."""
        live = self._live.get(request_id)
        if live is None:
            return
        self._finish(live, "abort", None)
        self._aborted.append(self._output(live))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._aborted)

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(len(s.running), len(s.waiting), self.manager.allocator.num_free, self.manager.num_pages,
                           s.num_preemptions, **self._counters)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Run one scheduler iteration; returns the requests that changed (new tokens, finished, aborted)."""
        outputs, self._aborted = self._aborted, []
        plan = self.scheduler.schedule()
        self._release(plan.preempted)
        changed: list[_Live] = []
        if plan.decode:
            changed += self._run_decode(plan.decode)
        for chunk in plan.prefill:
            live = self._run_chunk(chunk)
            if live is not None:
                changed.append(live)
        if plan.decode or plan.prefill:
            self._counters["steps"] += 1
        outputs += [self._output(live) for live in changed]
        return outputs

    def _run_decode(self, requests: list[Request]) -> list[_Live]:
        rows = [r.row for r in requests]
        ids = torch.tensor([[r.output_ids[-1]] for r in requests], device=self.device)
        positions = torch.tensor([[r.num_tokens - 1] for r in requests], device=self.device)
        pad_to = None
        if self.controller.compiles_decode:
            pad_to = next(s for s in self.graph_sizes if s >= len(rows))
        logits = self.controller.decode(self.patched.inner, rows, ids, positions, pad_to=pad_to)
        for r in requests:
            self.scheduler.decode_done(r)
        return self._sample([self._live[r.request_id] for r in requests], logits[:, -1])

    def _run_chunk(self, chunk: PrefillChunk) -> _Live | None:
        r = chunk.request
        if r.row is None:
            r.row = self.controller.add_sequences(1)[0]
            if r.metrics.first_scheduled_time is None:
                r.metrics.first_scheduled_time = time.monotonic()
        ids = torch.tensor([r.prefill_ids[chunk.start:chunk.stop]], device=self.device)
        positions = torch.arange(chunk.start, chunk.stop, device=self.device)[None, :]
        valid = torch.ones(1, chunk.stop - chunk.start, dtype=torch.bool)
        logits = self.controller.prefill(self.patched.inner, [r.row], ids, None, positions, valid, 1,
                                         final=chunk.final)
        self._counters["prompt_tokens"] += chunk.stop - chunk.start
        self.scheduler.chunk_done(chunk)
        if not chunk.final:
            return None
        return self._sample([self._live[r.request_id]], logits[:, -1])[0]

    def _sample(self, lives: list[_Live], logits: torch.Tensor) -> list[_Live]:
        """Sample one token per request from ``logits [batch, vocab]``; apply stop conditions."""
        tokens = sample(logits, [lv.request.params for lv in lives], [lv.generator for lv in lives]).tolist()
        now = time.monotonic()
        for live, token in zip(lives, tokens):
            r = live.request
            r.output_ids.append(token)
            r.metrics.num_generated_tokens = len(r.output_ids)
            r.metrics.first_token_time = r.metrics.first_token_time or now
            self._counters["generation_tokens"] += 1
            reason, stop = live.detok.append(token)
            if reason is None and r.num_tokens >= self.max_model_len:
                reason = "length"
            if reason is not None:
                self._finish(live, reason, stop)
        return lives

    def _finish(self, live: _Live, reason: str, stop: str | int | None) -> None:
        r = live.request
        self.scheduler.finish(r, reason, stop)
        self._release([r])
        r.metrics.finished_time = time.monotonic()
        del self._live[r.request_id]

    def _release(self, requests: list[Request]) -> None:
        rows = [r.row for r in requests if r.row is not None]
        self.controller.release_rows(rows)
        for r in requests:
            r.row = None

    def _output(self, live: _Live) -> RequestOutput:
        r, d = live.request, live.detok
        finished = r.finish_reason is not None
        new_ids = r.output_ids[live.reported:]
        live.reported = len(r.output_ids)
        completion = CompletionOutput(0, d.text, list(r.output_ids), r.finish_reason, r.stop_reason,
                                      d.delta(finished), new_ids)
        # prompt_token_ids is the engine's own list (copying a long prompt every step costs more): do not mutate it
        return RequestOutput(r.request_id, r.prompt, r.prompt_ids, [completion], finished, replace(r.metrics))


def kv_budget_bytes(config: ServingConfig, device: torch.device) -> int:
    """Bytes the KV pool may take: ``kv_cache_memory`` (bytes, or a fraction of the free GPU memory), or
    ``gpu_memory_utilization`` (vLLM's meaning: the process's share of the GPU's total memory, weights and
    activations included), or the default (0.85 of free GPU memory; 1 GiB on CPU)."""
    cuda = torch.device(device).type == "cuda"
    mem, util = config.kv_cache_memory, config.gpu_memory_utilization
    if util is not None:
        if not cuda:
            raise ValueError("gpu_memory_utilization needs a CUDA device; pass kv_cache_memory in bytes on CPU")
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * util) - (total - free)
        if budget <= 0:
            raise ValueError(f"gpu_memory_utilization={util} leaves no room for the KV pool: the process already "
                             f"uses {(total - free) / 2**30:.1f} GiB of {total / 2**30:.1f} GiB; raise it")
        return budget
    if mem is None:
        return int(torch.cuda.mem_get_info(device)[0] * _GPU_KV_FRACTION) if cuda else _CPU_KV_MEMORY
    if 0 < mem <= 1:
        if not cuda:
            raise ValueError("kv_cache_memory as a fraction needs a CUDA device; pass bytes on CPU")
        return int(torch.cuda.mem_get_info(device)[0] * mem)
    return int(mem)


def _eos_ids(model: nn.Module, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update(value if isinstance(value, (list, tuple)) else [value])
    return ids

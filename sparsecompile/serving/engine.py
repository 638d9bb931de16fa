"""LLMEngine: continuous batching over one patched model (the serving runtime's core, not thread-safe).

One implementation: the engine drives the very SparseController that ``optimize()`` installs (same
method runtime, CacheManager, ops and compiled decode step as ``model.generate()``); it only replaces
HF's generation loop with the :class:`Scheduler`'s. A step that only decodes runs one forward over every
request past its prompt (padded to a CUDA-graph batch size when decode is compiled); any other step runs its
decode tokens and every group of prompt chunks (chunks of similar lengths, left-padded) in one forward
(``enable_mixed_chunk``, ``runtime/mixed.py``); then it samples once, applies stop conditions, and frees the rows
of finished, aborted and preempted requests at once.

A request with ``n > 1`` is one scheduled sequence until its prompt is prefilled; the prompt's last logits then
give each of the ``n`` completions its first token (each from its own generator, see ``child_seed``), and the
``n - 1`` siblings get rows holding the prompt's KV through :meth:`LLMEngine._fork_row` and decode on their own.
Logprobs (``logprobs``, ``prompt_logprobs``) are computed only for the requests that ask for them.

Multi-turn reuse (``reuse.py``): a request with a ``chain_id`` leaves its row idle under that id when it finishes,
and a continuation reattaches it and prefills only its new tokens; with ``enable_prefix_caching`` (methods that keep
every token) full prompt pages are shared between requests. Both hold pages the scheduler counts as reclaimable.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from dataclasses import dataclass, field, replace

from torch import nn

from ..config import ServingConfig
from ..runtime.compilation import allow_recompiles, wanted
from ..runtime.row_ops import table_width
from .detokenizer import Detokenizer, text_decoder
from .interface import ServedModel
from .logprobs import LogprobRecorder
from .outputs import (
    RequestMetrics,
    RequestOutput,
    RequestRejected,
    SamplingParams,
    child_seed,
)
from .patched import PatchedServedModel, eos_token_ids
from .pool_size import kv_budget_bytes, pages_from_memory
from .prune import Pruner, PruneResult, PruneSpec
from .request import Request
from .request_state import LiveSequence, RequestGroup
from .reuse import KVReuse, ReuseStats, fingerprint
from .sampling import TokenHistory, make_generator
from .scheduler import Scheduler, pack_chunks
from .step_forwards import StepForwards
from .step_sampling import StepSampling

SERVING_PREFILL_CHUNK = 8192  # tokens per step when neither max_num_batched_tokens nor prefill_chunk_size is set


class EngineUnavailableError(RuntimeError):
    """The engine was called from a thread other than the one bound to it (see ``LLMEngine.bind_thread``), or after
    its model's patch was undone; nothing was changed."""


def _driven(method):
    """An engine method that changes state: refused from any thread but the one bound by ``bind_thread``, and once
    the model's patch was undone (``restore()``, or the model optimized again, e.g. by another ``LLM``)."""

    @functools.wraps(method)
    def checked(self, *args, **kwargs):
        if self.controller.manager is None:
            raise EngineUnavailableError(
                "this engine's model was restore()d or optimize()d again (another LLM over the same model object, or "
                "optimize()), which closed the KV pool it serves from: make a new LLM (one LLM per model object at a "
                "time)")
        owner = self.controller.owner
        if owner is not None and owner[0] != threading.get_ident():
            raise EngineUnavailableError(
                f"this LLMEngine is driven by {owner[1]} (the engine is not thread-safe): send the request through it "
                "(the server's HTTP API or its AsyncEngine), or serve offline work from another LLM instance")
        return method(self, *args, **kwargs)

    return checked


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
    reuse: ReuseStats = field(default_factory=ReuseStats)  # chains, prefix cache, reclaimable pages


class LLMEngine(StepSampling, StepForwards):
    """See module docstring. Built over a model patched by ``sparsecompile.optimize()`` (``sparsecompile.LLM``
    does both), or over any :class:`ServedModel` (an exported artifact's programs: ``sparsecompile.load``)."""

    def __init__(self, model: nn.Module | ServedModel, tokenizer, config: ServingConfig | None = None) -> None:
        patched = PatchedServedModel(model) if isinstance(model, nn.Module) else model
        config = config or ServingConfig()
        self.config = config
        self.model, self.tokenizer, self.patched = model, tokenizer, patched
        self.controller = c = patched.controller
        self.method = c.runtime.name
        self.model_name = config.model_name or patched.name or "sparsecompile"
        limit = patched.max_length or 4096
        self.max_model_len = min(config.max_model_len or limit, limit)
        max_num_seqs = config.max_num_seqs
        chunk = c.prefill_chunk
        if c.config.prefill_chunk_size is None:  # serving default: a chunk fills at most the step's token budget
            # (8192 unless max_num_batched_tokens says otherwise, as in vLLM), short enough to keep streams moving; a
            # larger budget asks for larger steps (a lone 128K prompt then runs whole, as generate() runs it: chunks
            # of 8192 cost 1.45x the whole prompt's time at 128K on the H200)
            cap = config.max_num_batched_tokens or SERVING_PREFILL_CHUNK
            chunk = min(chunk or cap, cap)
        chunk = chunk or self.max_model_len
        self.max_num_batched_tokens = config.max_num_batched_tokens or max(chunk, max_num_seqs)
        self.device = c.layout.device
        idle_rows = max_num_seqs if config.max_idle_chains is None else config.max_idle_chains
        rows = max_num_seqs + idle_rows + 1  # the running requests, the idle chains and the decode padding row
        # room for one max_model_len prompt's buffers outside the pool, which the scheduler reserves prompts against
        # (a pool of a given size leaves that room to the caller)
        c.oracle.buffer_budget = 0 if c.config.num_pages else c.oracle.prompt_buffer_bytes(self.max_model_len)
        num_pages = c.config.num_pages or pages_from_memory(c, kv_budget_bytes(config, self.device),
                                                            self.max_model_len, max_num_seqs, rows)
        self.row_pages = math.ceil((self.max_model_len + 1) / c.layout.page_size)  # pages a sequence may use
        self.manager = c.build_pool(num_pages, rows, table_width(self.row_pages))  # the table: aligned, a bit wider
        self.reuse = KVReuse(c, fingerprint(c, self.model_name), prefix_caching=config.enable_prefix_caching,
                             max_idle_chains=idle_rows)
        self.scheduler = Scheduler(c.oracle, num_pages, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=self.max_num_batched_tokens, prefill_chunk_size=chunk,
                                   prefill_mode=c.runtime.prefill_mode, max_model_len=self.max_model_len,
                                   reuse=self.reuse,
                                   max_prefill_tokens_while_decoding=config.max_prefill_tokens_while_decoding,
                                   replay_outputs=not c.runtime.recomputes_by_prefill)
        self.pruner = Pruner(self)
        sizes = config.cuda_graph_sizes or [1 << i for i in range(max_num_seqs.bit_length())]
        self.graph_sizes = sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})
        if c.decode_step_compiles:
            allow_recompiles(2 * len(self.graph_sizes) * len(c.runtime.decode_variants) + 8)
        # one forward per mixed step: needs the patched HF forward (an artifact's programs are traced per phase)
        self._mixes_steps = config.enable_mixed_chunk and isinstance(patched, PatchedServedModel)
        self._forward = patched.inner  # of prefill and mixed steps (decode steps have their own compiled unit)
        # mixed steps recorded per shape and replayed (CUDA graphs; not under tensor parallelism, whose ranks mirror
        # rank 0's forwards call by call)
        self.replays_mixed_steps = (self._mixes_steps and config.mixed_cuda_graphs
                                    and config.tensor_parallel_size == 1 and self.device.type == "cuda"
                                    and wanted(c.config.cuda_graphs, self.device)
                                    and c.replay_mixed_steps(self.graph_sizes, self.max_num_batched_tokens))
        if config.compile_prefill:
            if not isinstance(patched, PatchedServedModel):
                raise ValueError("compile_prefill applies to a model patched by optimize(); an exported artifact "
                                 "runs its own prefill program")
            from ..models.compiled_forward import CompiledForward  # imports the HF glue: not for artifacts

            self._forward = CompiledForward(model)
        self.eos_token_ids = patched.eos_token_ids | eos_token_ids(None, tokenizer)
        self.vocab_size = patched.vocab_size
        self._groups: dict[str, RequestGroup] = {}  # by request id
        self._live: dict[Request, LiveSequence] = {}  # by scheduled sequence
        self._logprobs = LogprobRecorder(tokenizer)
        self._decode_text = text_decoder(tokenizer)  # every request's detokenizer decodes through it
        self._aborted: list[RequestOutput] = []
        self._counters = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}
        self._default_seeds = 0  # requests seeded from config.seed so far

    # ------------------------------------------------------------------ requests
    def bind_thread(self, owner: str | None) -> None:
        """From now on only the calling thread (described by ``owner`` in errors) may change the engine: requests,
        steps, chains, prunes; None unbinds. A server's engine thread binds itself, so an ``LLM.generate`` from
        another thread gets a clear error instead of racing it (so does the patched model's ``generate()`` / forward:
        the binding is the controller's)."""
        self.controller.owner = None if owner is None else (threading.get_ident(), owner)

    @_driven
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None, *,
                    prompt_text: str | None = None, chain_id: str | None = None) -> None:
        """Queue a request; :class:`RequestRejected` (with the reason) when it can never be served.

        ``prompt_text``: with token ids, the text they came from (a rendered chat), reported as the output's
        ``prompt``. A request without a seed gets the next default seed when ``ServingConfig.seed`` is set.
        ``chain_id``: the conversation this request belongs to. If its prompt extends the processed tokens of the
        idle chain under that id, the chain's KV and method state are reattached and only the new tokens are
        prefilled; when it finishes (stop / length), its state stays idle under that id for the next turn.
        """
        params = params or SamplingParams()
        if request_id in self._groups:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        if chain_id is not None and (not isinstance(chain_id, str) or not chain_id):
            raise RequestRejected(f"chain_id must be a non-empty string, got {chain_id!r}")
        if chain_id is not None and params.n > 1:
            raise RequestRejected("chain_id continues one conversation: it needs n=1 (fork the chain with fork_chain "
                                  "to branch it)")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer(prompt).input_ids
        else:
            text, ids = prompt_text, list(prompt)
        vocab = self.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise RequestRejected(f"prompt token ids must be integers in [0, {vocab})")
        params.validate()
        if any(t >= vocab for t in params.logit_bias or {}):
            raise RequestRejected(f"logit_bias keys must be token ids in [0, {vocab})")
        if params.seed is None and self.config.seed is not None:
            params = replace(params, seed=self.config.seed + self._default_seeds)
            self._default_seeds += 1
        metrics = RequestMetrics(time.monotonic(), num_prompt_tokens=len(ids))
        request = Request(request_id, ids, params, metrics, prompt=text, chain_id=chain_id)
        self.scheduler.add(request)
        group = RequestGroup(request_id, text, ids, params, metrics)
        self._groups[request_id] = group
        self._add_seq(group, request)

    def _add_seq(self, group: RequestGroup, request: Request) -> LiveSequence:
        """Track ``request`` as completion ``len(group.seqs)`` of ``group``."""
        params, index = group.params, len(group.seqs)
        live = LiveSequence(request, Detokenizer(self.tokenizer, params, self.eos_token_ids, request.prompt_ids,
                                                   self._decode_text),
                            make_generator(child_seed(params.seed, index), self.device), group, index)
        if params.processes_logits:
            live.history = TokenHistory(request.prompt_ids, request.output_ids)
        if params.logprobs is not None:
            live.logprobs, live.cumulative_logprob = [], 0.0
        group.seqs.append(live)
        self._live[request] = live
        return live

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

    @_driven
    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its pages (unknown or finished ids are ignored)."""
        group = self._groups.get(request_id)
        if group is None:
            return
        group.aborted = True
        for live in list(group.seqs):
            if live.request.finish_reason is None:
                self._finish(live, "abort", None)
        self._aborted.append(group.output())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._aborted)

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(len(s.running), len(s.waiting), self.manager.allocator.num_free, self.manager.num_pages,
                           s.num_preemptions, **self._counters, reuse=self.reuse.stats())

    # ------------------------------------------------------------------ idle state (chains, prefix cache)
    @_driven
    def fork_chain(self, source: str, chain_id: str) -> None:
        """Branch a conversation: the idle chain ``source`` is copied (pages shared copy-on-write) to a new idle
        chain ``chain_id``; continuing one never changes the other."""
        queued = (*self.scheduler.running, *self.scheduler.waiting)
        if any(r.chain_id == chain_id for r in queued):  # its finish would park its state under that id
            raise ValueError(f"chain {chain_id!r} belongs to a request that has not finished; fork_chain needs a new "
                             "chain id")
        self.reuse.fork_chain(source, chain_id)

    @_driven
    def drop_chain(self, chain_id: str) -> bool:
        """Free the idle chain ``chain_id`` now (False: there is none)."""
        return self.reuse.drop_chain(chain_id)

    @_driven
    def reset_prefix_cache(self) -> int:
        """Evict every prefix block no request uses; returns the pages freed."""
        return self.reuse.reset_prefix_cache()

    @_driven
    def release_idle(self) -> None:
        """Free every idle chain and every idle prefix block."""
        self.reuse.release_idle()

    @_driven
    def prune(self, spec: PruneSpec) -> PruneResult:
        """Interval pruning of an idle chain now (``prune.py``); raises ``PruneRejected`` with the reason (nothing
        changed), ``PruneBlocked`` when the state is in use."""
        return self.pruner.prune(spec)

    @_driven
    def submit_prune(self, spec: PruneSpec) -> PruneResult:
        """Like :meth:`prune`, but a prune of state in use waits (``blocked``) and runs once it is idle; the result
        (``status`` pending / blocked / completed / failed) is kept under its ``prune_id``."""
        return self.pruner.submit(spec)

    def prune_status(self, prune_id: str) -> PruneResult | None:
        return self.pruner.status(prune_id)

    # ------------------------------------------------------------------ one step
    @_driven
    def step(self) -> list[RequestOutput]:
        """Run one scheduler iteration; returns the requests that changed (new tokens, finished, aborted)."""
        outputs, self._aborted = self._aborted, []
        plan = self.scheduler.schedule()
        self._release(plan.preempted)
        self.scheduler.settle()
        if not (plan.decode or plan.prefill or plan.preempted or self.scheduler.running) and self.scheduler.waiting:
            self._abort_stuck(self.scheduler.waiting[0])
        changed: list[LiveSequence] = []
        # prompt chunks in groups of similar lengths (each left-padded within max_num_batched_tokens)
        groups = pack_chunks(plan.prefill, self.max_num_batched_tokens) if plan.prefill else []
        if self._mixes_steps and len(groups) + bool(plan.decode) > 1:  # one forward for the decodes and every group
            changed += self._run_mixed(plan.decode, groups)
        else:  # decode only (its CUDA graph), one group only, or mixing off: a forward each
            if plan.decode:
                changed += self._run_decode(plan.decode)
            for group in groups:
                changed += self._run_group(group)
        if plan.decode or plan.prefill:
            self._counters["steps"] += 1
        outputs += self._outputs(changed)
        return outputs

    def _abort_stuck(self, request: Request) -> None:
        """Nothing runs, every idle state was reclaimable, and the queue's head was still not admitted: it never
        will be, and everything behind it would wait forever. Abort its request (logged) instead. No known path
        leads here since the 2026-12-05 fixes (a preempted eviction request's prompt + output prefill, a chain
        resume larger than the pool); this keeps a future one from hanging the engine."""
        group = self._live[request].group
        logging.getLogger("sparsecompile").warning(
            "request %s aborted: it cannot be admitted into an idle engine (prefill of %d tokens; KV pool of %s)",
            group.request_id, len(request.prefill_ids), self.scheduler.capacity)
        self.abort_request(group.request_id)

    # ------------------------------------------------------------------ finishing and outputs
    def _finish(self, live: LiveSequence, reason: str, stop: str | int | None) -> None:
        r = live.request
        self.scheduler.finish(r, reason, stop)
        self.reuse.finish(r, keep=reason in ("stop", "length"))  # parks a chain, caches blocks, frees the row
        r.metrics.finished_time = time.monotonic()
        del self._live[r]
        if live.group.done:
            self._groups.pop(live.group.request_id, None)
        if self.pruner.has_blocked:  # a prune waiting for this state runs now that it is idle
            self.pruner.retry()

    def _release(self, requests: list[Request]) -> None:
        """Free the rows of preempted requests (their full blocks stay cached; a reattached chain is gone)."""
        for r in requests:
            self.reuse.preempted(r)

    @staticmethod
    def _outputs(changed: list[LiveSequence]) -> list[RequestOutput]:
        """One output per request with a changed sequence (in order of first change); a ``FINAL_ONLY`` request's
        only when it finishes."""
        groups = {id(lv.group): lv.group for lv in changed}.values()
        return [group.output() for group in groups if group.reports_every_step or group.done]

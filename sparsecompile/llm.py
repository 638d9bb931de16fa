"""``sparsecompile.LLM``: offline batched generation with continuous batching, vLLM-style.

    llm = sparsecompile.LLM("path/to/model", method="snapkv", budget=512, max_num_seqs=32)
    outs = llm.generate(["Hello", "Tell me a story"], sparsecompile.SamplingParams(temperature=0, max_tokens=64))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from .config import OPTION_KINDS, ServingConfig, dtype_attribute
from .methods.registry import fill_text_options
from .serving.engine import EngineUnavailableError, LLMEngine
from .serving.outputs import RequestOutput, RequestOutputKind, SamplingParams

PromptInput = str | Sequence[int] | Mapping[str, Any]
_PROMPT_KEYS = ("prompt", "prompt_token_ids")
_PROMPT_FORMS = ("a prompt is a string, a list of token ids, or a dict {'prompt': text} / {'prompt_token_ids': "
                 "[ids]}")


def _token_ids(value: Any, where: str) -> list[int]:
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):  # a tensor or array of ids
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{where} must be a list of token ids, got {type(value).__name__}")
    return list(value)


def _one_prompt(prompt: Any, index: int) -> tuple[str | None, list[int] | None]:
    """``(text, token_ids)`` of one prompt: token_ids None means "tokenize the text"."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, Mapping):
        unknown = sorted(set(prompt) - set(_PROMPT_KEYS))
        if unknown:
            raise TypeError(f"prompt {index}: unsupported key(s) {unknown} (multimodal inputs and other vLLM prompt "
                            f"fields are not supported); {_PROMPT_FORMS}")
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise TypeError(f"prompt {index}: 'prompt' must be a string, got {type(text).__name__}")
        if prompt.get("prompt_token_ids") is not None:
            return text, _token_ids(prompt["prompt_token_ids"], f"prompt {index}: 'prompt_token_ids'")
        if text is None:
            raise TypeError(f"prompt {index}: the dict has neither 'prompt' nor 'prompt_token_ids'; {_PROMPT_FORMS}")
        return text, None
    if isinstance(prompt, Sequence) or hasattr(prompt, "tolist"):
        return None, _token_ids(prompt, f"prompt {index}")
    raise TypeError(f"prompt {index}: {_PROMPT_FORMS}; got {type(prompt).__name__}")


def normalize_prompts(prompts: PromptInput | Sequence[PromptInput]) -> list[tuple[str | None, list[int] | None]]:
    """One prompt or a list of them (text, token ids, vLLM prompt dicts, mixed) as ``(text, token_ids)`` pairs."""
    if hasattr(prompts, "tolist") and not isinstance(prompts, (list, tuple)):
        prompts = prompts.tolist()  # a tensor: one prompt [n] or a batch [b, n]
    single = isinstance(prompts, (str, Mapping)) or (
        isinstance(prompts, Sequence) and len(prompts) > 0 and isinstance(prompts[0], int))
    if single:
        prompts = [prompts]
    if not isinstance(prompts, Sequence):
        raise TypeError(f"{_PROMPT_FORMS}, or a list of them; got {type(prompts).__name__}")
    return [_one_prompt(p, i) for i, p in enumerate(prompts)]


def torch_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A ``torch.dtype`` from a dtype or one of ``config.DTYPE_NAMES`` ("auto", None: the device's default)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = dtype_attribute(dtype)
    return None if name is None else getattr(torch, name)


class LLM:
    """An engine over one model and one sparse method.

    Args:
        model_or_path: an HF causal LM (then pass ``tokenizer``), an HF directory, a ``.gguf`` file, a Hugging Face
            model id (from transformers' cache, or the hub when reachable), or None for the embedded
            SmolLM2-135M-Instruct.
        method: a registered method (``sparsecompile.available_methods()``).
        tokenizer: required when ``model_or_path`` is a model object.
        device, dtype: where and how to load a path or model id (default: CUDA + bf16 when available, else CPU +
            fp32); ``dtype`` is a ``torch.dtype`` or a name: "auto" (that default), "float32" / "float",
            "bfloat16", "float16" / "half".
        **options: serving options (:class:`sparsecompile.config.ServingConfig`: ``max_num_seqs``,
            ``max_num_batched_tokens``, ``kv_cache_memory``, ``gpu_memory_utilization``, ``max_model_len``,
            ``cuda_graph_sizes``, ``model_name``, ``seed``, ``tensor_parallel_size``: see
            ``sparsecompile/parallel.py``), engine options (:class:`sparsecompile.config.EngineConfig`, as
            ``optimize()`` takes them; ``block_size`` is vLLM's name for ``page_size``) and the method's options.
            An option none of them declares is refused, naming which kind it was taken for.
    """

    def __init__(self, model_or_path: nn.Module | str | os.PathLike | None = None, method: str = "vanilla", *,
                 tokenizer=None, device: str | None = None, dtype: torch.dtype | str | None = None,
                 **options: Any) -> None:
        # optimize (and with it the HF glue) is imported here, not at module level: an LLM over an exported
        # artifact (from_engine) never needs it, and importing it costs seconds of a load's time
        from .optimize import optimize, split_method_options

        routed = split_method_options(method, options, accepted=OPTION_KINDS)  # refuse bad options before loading
        serving = ServingConfig(**routed["serving"])
        dtype = torch_dtype(dtype)
        self._ids = itertools.count()
        self._tensor_parallel = None
        tp = max(serving.tensor_parallel_size, routed["engine"].get("tp_size", 1))
        if isinstance(model_or_path, nn.Module):
            if tokenizer is None:
                raise ValueError("pass tokenizer= together with a model object")
            if dtype is not None or device is not None:
                raise ValueError("dtype= and device= apply when LLM loads the model from a path or id; move a model "
                                 "object yourself (model.to(device, dtype)) before passing it")
            model = model_or_path
        elif tp == 1:
            from .models.default_model import load_model

            model, loaded_tokenizer = load_model(model_or_path, dtype=dtype, device=device)
            tokenizer = tokenizer or loaded_tokenizer
        if serving.model_name is None and not isinstance(model_or_path, nn.Module):
            from .models.default_model import resolve_model_path

            serving.model_name = str(model_or_path) if model_or_path is not None else resolve_model_path(None).name
        fill_text_options(method, routed["method"], tokenizer)  # KVzip's lead-ins (TP ranks: their own tokenizer)
        if tp > 1:  # every rank builds its shard; rank 0 drives the others (sparsecompile/parallel.py)
            from .parallel import launch

            self._tensor_parallel = run = launch(model_or_path, method, {**routed["engine"], **routed["method"]}, tp,
                                                 dtype=dtype, device=device)
            if not run.is_driver:  # a worker rank of a torchrun job: it served rank 0 until rank 0 closed
                self.llm_engine = None
                return
            model, tokenizer = run.model, tokenizer or run.tokenizer
        else:
            optimize(model, method=method, **routed["engine"], **routed["method"])
        try:
            self.llm_engine = LLMEngine(model, tokenizer, serving)
        except BaseException:
            self.close()  # tensor-parallel workers stop with it
            raise

    @property
    def is_driver(self) -> bool:
        """False on a worker rank of a tensor-parallel torchrun job (its constructor served rank 0's steps)."""
        return self.llm_engine is not None

    def close(self) -> None:
        """Stop the tensor-parallel workers (rank 0); a no-op without tensor parallelism."""
        if self._tensor_parallel is not None:
            self._tensor_parallel.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """An LLM over a ready engine (``sparsecompile.load`` builds one over an exported artifact)."""
        llm = cls.__new__(cls)
        llm.llm_engine = engine
        llm._ids = itertools.count()
        llm._tensor_parallel = None
        return llm

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, chain_ids: Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the prompts' order.

        A prompt is text, a list of token ids, or vLLM's dicts ``{"prompt": text}`` / ``{"prompt_token_ids":
        [...]}`` (a ``"prompt"`` next to the ids is reported as the output's prompt text); one prompt or a list,
        forms mixed. ``sampling_params``: one for all prompts or one per prompt (default ``SamplingParams()``).
        ``chain_ids``: one per prompt (None: no chain): the conversation each prompt continues. A prompt that starts
        with the tokens the chain processed (its previous prompt + output) reuses the chain's KV and prefills only
        the rest; each finished request leaves its state under its chain id for the next turn (outputs carry
        ``chain_id``; ``metrics.chain_hit`` / ``chain_miss_reason`` say what happened).
        Every request is validated before any runs; a rejected one raises ``RequestRejected``.
        """
        if self.llm_engine is None:
            raise RuntimeError("this LLM is a tensor-parallel worker rank (rank 0 drives the engine)")
        prompts = normalize_prompts(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        chains = [None] * len(prompts) if chain_ids is None else list(chain_ids)
        if len(chains) != len(prompts):
            raise ValueError(f"got {len(chains)} chain ids for {len(prompts)} prompts")
        bad = next((p for p in params if not isinstance(p, SamplingParams)), None)
        if bad is not None:
            raise TypeError(f"sampling_params must be SamplingParams (one or one per prompt), got {type(bad).__name__}")
        # only finished requests come back: the engine builds no per-step outputs (vLLM's LLM does the same)
        final_only = {id(p): replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params}
        params = [final_only[id(p)] for p in params]
        engine = self.llm_engine
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        try:
            for request_id, (text, token_ids), p, chain in zip(ids, prompts, params, chains):
                extra = {"chain_id": chain} if chain is not None else {}
                if token_ids is None:
                    engine.add_request(request_id, text, p, **extra)
                else:
                    engine.add_request(request_id, token_ids, p, prompt_text=text, **extra)
            return self._run(engine, ids, use_tqdm)
        except EngineUnavailableError:  # another thread drives the engine, or its pool closed: nothing was queued
            raise
        except BaseException:
            for request_id in ids:  # leave nothing queued or allocated behind
                engine.abort_request(request_id)
            engine.step()
            raise

    def chat(self, messages: Sequence[dict[str, str]] | Sequence[Sequence[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Like :meth:`generate`, with each conversation rendered by the tokenizer's chat template (the rendered
        text is each output's ``prompt``)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            text, token_ids = self.llm_engine.chat_prompt(list(conversation))
            prompts.append({"prompt": text, "prompt_token_ids": token_ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def fork_chain(self, source: str, chain_id: str) -> None:
        """Branch the idle conversation ``source`` into a new one, ``chain_id`` (KV shared copy-on-write)."""
        self.llm_engine.fork_chain(source, chain_id)

    def drop_chain(self, chain_id: str) -> bool:
        """Free an idle conversation's KV now (False: no idle chain under that id)."""
        return self.llm_engine.drop_chain(chain_id)

    def prune(self, target: str | Sequence[int], ranges: Sequence[tuple[int, int]], keep_tokens: int,
              policy: str = "kvzip"):
        """Interval pruning of an idle conversation: in each layer and KV head keep at most ``keep_tokens`` of the
        entries whose positions fall in ``ranges`` (half-open, page-aligned ``[L, R)``; one budget for all; 0 drops
        them), chosen by ``policy`` ("kvzip" or "snapkv"). ``target``: a chain id, or its complete token ids.
        Returns a ``PruneResult`` (entries removed, pages freed); raises ``PruneRejected`` with the reason, having
        changed nothing. Later continuations still match the full token history and report
        ``metrics.compressed_history``."""
        from .serving.prune import PruneSpec

        spec = PruneSpec([tuple(r) for r in ranges], keep_tokens, policy,
                         chain_id=target if isinstance(target, str) else None,
                         token_ids=None if isinstance(target, str) else list(target))
        return self.llm_engine.prune(spec)

    def reset_prefix_cache(self) -> int:
        """Evict every cached prefix block no request uses (``enable_prefix_caching``); returns the pages freed."""
        return self.llm_engine.reset_prefix_cache()

    @staticmethod
    def _run(engine: LLMEngine, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="requests", unit="req", dynamic_ncols=True)
        try:
            while len(finished) < len(ids):
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                if bar is not None:
                    s = engine.stats()
                    bar.set_postfix(running=s.num_running, waiting=s.num_waiting, gen_tok=s.generation_tokens,
                                    refresh=False)
        finally:
            if bar is not None:
                bar.close()
        return [finished[i] for i in ids]

"""Patching an HF causal LM in place: its ``forward`` and ``generate`` go through the SparseController.

The patched ``forward`` turns HF arguments (2D padding mask, position ids, the cache) into the
controller's terms (valid tokens, logical positions, manager rows), runs prefill chunks eagerly or
the compiled decode step, and returns a normal ``CausalLMOutputWithPast`` carrying a
:class:`SparseCache`. The original forward is called with ``use_cache=False``: transformers never
sees or builds a KV cache; the attention layers reach the pool through the controller.
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..kernels.dense_attention import CALLS
from ..passes.capture import CaptureError
from ..passes.sdpa_rewrite import sdpa_rewrite_backend
from ..runtime.compilation import compile_dynamic
from ..runtime.controller import SparseController
from .attention import CONTROLLER_ATTR
from .fast_generate import MODEL_CACHE_FIELD, SparseSampleLoop
from .generate_args import GENERATE_ONLY, check_generate_arguments, is_given
from .hf_cache import SparseCache

# Arguments the patched forward consumes itself; anything else is passed to the original forward.
_CONSUMED = {"input_ids", "inputs_embeds", "attention_mask", "position_ids", "cache", "past_key_values", "use_cache",
             "logits_to_keep", "return_dict", "labels", "output_attentions", "output_hidden_states", "cache_position"}


_PATCH_ATTR = "_sparsecompile"  # where a patched model keeps its patch (a plain instance attribute)


def patch_of(model: nn.Module) -> PatchedModel | SdpaFallback | None:
    """The sparsecompile patch installed on ``model`` (None if it is not patched): the one accessor."""
    return getattr(model, "__dict__", {}).get(_PATCH_ATTR)


def patched_model(model: nn.Module) -> PatchedModel:
    """The patch of a model optimized with cache access (what the serving engine and the KV APIs drive)."""
    patch = patch_of(model)
    if not isinstance(patch, PatchedModel):
        why = ("it runs through the SDPA-rewrite fallback, which leaves the KV cache to transformers"
               if patch is not None else "it is not patched")
        raise ValueError(f"expected a model patched by sparsecompile.optimize() with cache access; {why}")
    return patch


def cache_argument_name(model: nn.Module) -> str:
    """``cache`` (transformers >= 5.2x) or ``past_key_values`` (earlier 5.x): the one the model's forward names, else
    (a forward taking the cache through ``**kwargs``) the one this transformers' models name."""
    params = inspect.signature(type(model).forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    from transformers import LlamaForCausalLM

    return "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


class PatchedModel:
    """Holds what the patched ``forward`` / ``generate`` of one model need."""

    def __init__(self, model: nn.Module, controller: SparseController, max_length: int | None) -> None:
        self.controller = controller
        self.max_length = max_length
        self.orig_forward = model.forward
        self.orig_generate = model.generate
        self.cache_name = cache_argument_name(model)
        self.has_logits_to_keep = "logits_to_keep" in inspect.signature(self.orig_forward).parameters
        self.signature = inspect.signature(self.orig_forward)
        self.generate_signature = inspect.signature(self.orig_generate)
        self.model_ref = weakref.ref(model)  # generate()'s argument checks read the model's generation_config
        self.last_cache = None  # weakref target for kv_stats(model)
        self.previous_attn: str | None = None  # the attention implementation restore() gives back

    # ------------------------------------------------------------------ the inner forward (stable for compile)
    def inner(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, position_ids: torch.Tensor,
              logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        kwargs: dict[str, Any] = {"use_cache": False, "return_dict": True}
        if self.has_logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        out = self.orig_forward(input_ids=input_ids, inputs_embeds=inputs_embeds, position_ids=position_ids, **kwargs)
        return out.logits

    def _check_thread(self) -> None:
        """A serving engine's thread may own the pool (``LLMEngine.bind_thread``): other threads must not touch it."""
        owner = self.controller.owner
        if owner is not None and owner[0] != threading.get_ident():
            raise RuntimeError(f"this model's KV pool is driven by {owner[1]} (not thread-safe): send the request "
                               "through the server, or call the model after the server stopped")

    def _check_cache(self, cache: Any, hint: str) -> None:
        """A cache passed in must be a SparseCache of this model's controller (its rows index this pool)."""
        if cache is None:
            return
        if not isinstance(cache, SparseCache):
            raise TypeError(f"sparsecompile manages the KV cache itself; got a {type(cache).__name__}. {hint}")
        if cache.controller is not self.controller:
            raise ValueError("this SparseCache holds another model's sequences (or this model was optimize()d again "
                             f"since): its rows would name other sequences of this model's KV pool. {hint}")

    # ------------------------------------------------------------------ forward
    def forward(self, *args, **kwargs):
        self._check_thread()
        bound = self.signature.bind_partial(*args, **kwargs)
        params = dict(bound.arguments)
        params.update(params.pop("kwargs", {}) or {})
        extra = sorted(k for k, v in params.items() if k not in _CONSUMED and k not in GENERATE_ONLY and is_given(v))
        if extra:
            raise TypeError(f"sparsecompile's patched forward does not support the argument(s) {extra}")
        if params.get("labels") is not None:
            raise ValueError("sparsecompile-patched models are inference-only: labels / loss are not supported")
        if params.get("output_attentions"):
            raise ValueError("output_attentions is not available with sparse attention")
        if params.get("output_hidden_states"):
            raise ValueError("output_hidden_states is not supported by sparsecompile's patched forward")
        input_ids, inputs_embeds = params.get("input_ids"), params.get("inputs_embeds")
        cache = params.get("cache") if params.get("cache") is not None else params.get("past_key_values")
        self._check_cache(cache, "Pass no cache (generate() creates a SparseCache) or a SparseCache returned by this "
                                 "model")
        transient = cache is None
        if transient:
            cache = SparseCache(self.controller)
        ref = input_ids if input_ids is not None else inputs_embeds
        batch, tokens = ref.shape[0], ref.shape[1]
        position_ids = params.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(tokens, device=ref.device)[None, :] + cache.processed
        position_ids = position_ids.expand(batch, tokens)
        mask = params.get("attention_mask")
        if mask is not None and mask.dim() != 2:
            raise ValueError("sparsecompile supports 2D padding masks only; got a "
                             f"{mask.dim()}D attention mask")
        valid = mask[:, -tokens:].bool() if mask is not None else torch.ones(batch, tokens, dtype=torch.bool)
        logits_to_keep = params.get("logits_to_keep") or 0
        if not isinstance(logits_to_keep, int):
            raise ValueError("sparsecompile supports an integer logits_to_keep only")
        max_len = self.max_length
        if max_len is not None and cache.processed + tokens > max_len:
            raise ValueError(f"input of {cache.processed + tokens} tokens exceeds the model's maximum length {max_len}")
        try:
            with torch.no_grad():
                logits = self._run(cache, input_ids, inputs_embeds, position_ids, valid, logits_to_keep)
        except BaseException:
            if transient:
                cache.release()
            raise
        cache.processed += tokens
        cache.next_positions = position_ids[:, -1:] + 1
        cache.prompt_pending = False
        self.last_cache = cache
        use_cache = params.get("use_cache")
        if use_cache is False:
            cache.release()
            cache = None
        out = CausalLMOutputWithPast(logits=logits, **{MODEL_CACHE_FIELD: cache})
        return out if params.get("return_dict", True) is not False else out.to_tuple()

    def _run(self, cache: SparseCache, input_ids, inputs_embeds, position_ids, valid, logits_to_keep) -> torch.Tensor:
        c = self.controller
        batch, tokens = position_ids.shape
        decode = (cache.is_allocated and cache.processed > 0 and tokens == 1 and inputs_embeds is None
                  and not cache.prompt_pending and bool(valid.all()))
        if decode:
            if batch != len(cache.rows):
                raise ValueError(f"the cache holds {len(cache.rows)} sequences but the input has {batch}")
            return c.decode(self.inner, cache.rows, input_ids, position_ids)
        if not cache.is_allocated:
            cache.allocate(batch, int(valid.sum(1).max()))
        elif batch != len(cache.rows):
            raise ValueError(f"the cache holds {len(cache.rows)} sequences but the input has {batch}")
        progress = None
        chunk = c.prefill_chunk
        if c.config.show_progress and chunk and tokens > chunk:
            from tqdm.auto import tqdm

            bar = tqdm(total=tokens, desc="prefill", unit="tok", leave=False)
            progress = bar.update
        try:
            return c.prefill(self.inner, cache.rows, input_ids, inputs_embeds, position_ids, valid, logits_to_keep,
                             progress)
        finally:
            if progress is not None:
                bar.close()

    # ------------------------------------------------------------------ generate
    def generate(self, *args, **kwargs):
        self._check_thread()
        checked = check_generate_arguments(self.model_ref(), self.generate_signature, args, kwargs, self.max_length)
        args, kwargs = checked.args, checked.kwargs
        cache = next((kwargs[k] for k in (self.cache_name, "past_key_values", "cache") if kwargs.get(k) is not None),
                     None)
        self._check_cache(cache, "Call generate() without a cache, or pass a SparseCache returned by a previous call")
        created = cache is None
        if created:
            cache = SparseCache(self.controller, expected_new_tokens=_expected_new_tokens(kwargs))
        # One spelling reaches HF, the one this transformers reads (5.25 warns when given both, or the deprecated
        # past_key_values).
        for name in ("past_key_values", "cache"):
            kwargs.pop(name, None)
        kwargs[self.cache_name] = cache
        # generate()'s first forward feeds its prompt (a continuation's new tokens): a prompt even when it is one
        # token, as it is when it is several (a method compresses it, OmniKV scores it), not a decode step
        cache.prompt_pending = True
        model_config = getattr(self.orig_generate.__self__, "generation_config", None)
        if kwargs.get("custom_generate") is None and _own_loop_applies(kwargs, model_config):
            # HF prepares, our loop decodes (models/fast_generate.py). HF hands a custom decoding method neither the
            # tokenizer nor the streamer: the loop gets the streamer here, and stop strings and token healing (which
            # need the tokenizer) keep HF's own loop, as does use_cache=False (every step re-reads the whole sequence).
            kwargs["custom_generate"] = SparseSampleLoop(self, streamer=kwargs.get("streamer"), user_cache=not created)
        try:
            out = self.orig_generate(*args, **kwargs)
        except BaseException:
            cache.prompt_pending = False  # a later direct forward of one token is a decode step again
            if created:
                cache.release()
            raise
        if created and not checked.return_dict:
            cache.release()
        return out


def _own_loop_applies(kwargs: dict, model_config) -> bool:
    config = kwargs.get("generation_config") or model_config
    stop_strings = kwargs.get("stop_strings") or getattr(config, "stop_strings", None)
    healing = kwargs.get("token_healing", getattr(config, "token_healing", False))  # needs the tokenizer as well
    use_cache = kwargs.get("use_cache", getattr(config, "use_cache", True))
    return not stop_strings and not healing and use_cache is not False


def _expected_new_tokens(kwargs: dict) -> int:
    config = kwargs.get("generation_config")
    new = kwargs.get("max_new_tokens") or getattr(config, "max_new_tokens", None)
    return int(new) if new else 256


def install(model: nn.Module, controller: SparseController, attention: list[nn.Module],
            max_length: int | None) -> PatchedModel:
    """Patch ``model`` in place; returns the :class:`PatchedModel` holding the originals."""
    patched = PatchedModel(model, controller, max_length)
    for module in attention:
        module.__dict__[CONTROLLER_ATTR] = controller  # plain attribute: not a submodule, not a buffer
    model.__dict__[_PATCH_ATTR] = patched
    params = list(model.parameters())
    controller.watch_parameters(params[:1] + params[-1:])  # a cast or move after optimize() changes both

    @functools.wraps(patched.orig_forward)
    def forward(*args, **kwargs):
        return patched.forward(*args, **kwargs)

    @functools.wraps(patched.orig_generate)
    def generate(*args, **kwargs):
        return patched.generate(*args, **kwargs)

    model.forward, model.generate = forward, generate
    return patched


def uninstall(model: nn.Module, attention: list[nn.Module]) -> None:
    patched = model.__dict__.pop(_PATCH_ATTR, None)
    if patched is None:
        return
    for module in attention:
        module.__dict__.pop(CONTROLLER_ATTR, None)
    model.__dict__.pop("forward", None)
    model.__dict__.pop("generate", None)


class SdpaFallback:
    """The patch of a model that ignores ``set_attn_implementation``: its forward runs compiled with the
    SDPA-rewrite backend, so each attention call is ``sparsecompile::dense_attention``; KV stays in HF's cache."""

    def __init__(self, model: nn.Module, use_inductor: bool, cuda_graphs: bool) -> None:
        self.orig_forward = model.forward
        self.backend = sdpa_rewrite_backend(use_inductor, cuda_graphs)
        self.compiled = compile_dynamic(self.orig_forward, self.backend)


def install_sdpa_fallback(model: nn.Module, use_inductor: bool, cuda_graphs: bool, num_layers: int) -> SdpaFallback:
    """Patch ``model`` through the SDPA-rewrite fallback and check that every layer's attention became our op."""
    patch = SdpaFallback(model, use_inductor, cuda_graphs)

    @functools.wraps(patch.orig_forward)
    def forward(*args, **kwargs):
        return patch.compiled(*args, **kwargs)

    model.__dict__[_PATCH_ATTR] = patch
    model.forward = forward
    before = CALLS[0]
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=next(model.parameters()).device), use_cache=False)
    if CALLS[0] - before < num_layers:
        uninstall(model, [])
        raise CaptureError(f"the SDPA-rewrite fallback reached {CALLS[0] - before} of {num_layers} attention layers; "
                           "refusing to run silently dense")
    return patch

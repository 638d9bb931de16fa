"""``generate()``'s decoding loop for patched models: HF's sampling semantics, the engine's step, no per-token sync.

transformers' ``generate()`` prepares everything (generation config, logits processors, stopping criteria, the
prompt) and then hands the loop to a decoding method; a patched model passes :class:`SparseSampleLoop` as that
method (``custom_generate``). The loop does what HF's ``_sample`` does, step for step and with the same tensor
ops, so outputs are identical for every option HF accepts (greedy, seeded sampling, logits processors, stopping
criteria, stop strings, streamers, ``return_dict_in_generate``), but:

* each decode step is the controller's (compiled, CUDA-graph) step, fed the sampled token **on the device**, not a
  trip through HF's ``prepare_inputs_for_generation`` and the patched ``forward``;
* the "all sequences finished?" check is copied to pinned memory asynchronously and read ``lag`` steps later, so
  the host queues the next steps while the GPU runs: generation stops up to ``lag`` steps late, and those steps are
  undone (output trimmed; the cache cropped back when it outlives the call). A method that cannot crop (eviction
  changes what it keeps) runs with ``lag = 0`` when its cache outlives the call (``return_dict_in_generate`` or a
  cache passed in), which reads the flag every step, as HF does;
* reaching ``max_length`` is known on the host in advance: the loop never runs a step past it.
"""

from __future__ import annotations

from collections import deque

import torch
from torch import nn
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMode
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..kernels.argmax import first_argmax
from .hf_cache import SparseCache

_OUTPUT_CACHE_FIELD = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"
MODEL_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
DEFAULT_LAG = 2  # steps the stop check trails the GPU by: enough for the host to stay ahead of it


class SparseSampleLoop:
    """A ``custom_generate`` decoding method (see module docstring). ``streamer``: HF does not hand custom decoding
    methods the streamer, so the patched ``generate()`` gives it here; ``user_cache``: the caller passed the cache in
    (it outlives the call)."""

    def __init__(self, patched, streamer=None, user_cache: bool = False, lag: int = DEFAULT_LAG) -> None:
        self.patched = patched
        self.streamer = streamer
        self.user_cache = user_cache
        self.lag = lag

    def __call__(self, model: nn.Module, input_ids: torch.LongTensor, logits_processor, stopping_criteria,
                 generation_config, synced_gpus: bool = False, streamer=None, **model_kwargs):
        mode = generation_config.get_generation_mode()
        if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
            raise ValueError(f"sparsecompile's generate() runs greedy search and sampling; {mode.value} is not "
                             "supported (use num_beams=1, no assistant, no penalty_alpha / dola)")
        if synced_gpus:
            raise ValueError("sparsecompile's generate() does not support synced_gpus (DeepSpeed ZeRO-3 / FSDP)")
        streamer = streamer or self.streamer
        config = generation_config
        if config.return_dict_in_generate and (config.output_attentions or config.output_hidden_states):
            raise ValueError("output_attentions / output_hidden_states are not available with sparse attention")
        pad = config._pad_token_tensor
        has_eos = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
        want_scores = config.return_dict_in_generate and config.output_scores
        want_logits = config.return_dict_in_generate and config.output_logits
        scores = () if want_scores else None
        raw_logits = () if want_logits else None

        outputs = model._prefill(input_ids, config, model_kwargs, is_first_iteration=True)
        cache: SparseCache = outputs[MODEL_CACHE_FIELD]
        model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs)
        returned = config.return_dict_in_generate or self.user_cache
        lag = self.lag if (not returned or self.patched.controller.runtime.keeps_all_tokens) else 0
        # the next token's position, in the numbering the prefill used (by the padding mask when the model's forward
        # takes position_ids, else every column): HF's own loop numbers decode steps the same way
        positions = cache.next_positions.to(device=input_ids.device, dtype=torch.long)
        max_length = stopping_criteria.max_length
        unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
        checks: deque = deque()  # (step, pinned finished flag, pinned tokens, event), oldest first
        logits, step, stop_at = outputs.logits, 0, None
        del outputs
        while True:
            next_logits = logits[:, -1].to(copy=True, dtype=torch.float32, device=input_ids.device)
            next_scores = logits_processor(input_ids, next_logits)
            if want_scores:
                scores += (next_scores,)
            if want_logits:
                raw_logits += (next_logits,)
            if config.do_sample:
                next_tokens = torch.multinomial(nn.functional.softmax(next_scores, dim=-1), num_samples=1).squeeze(1)
            else:
                next_tokens = first_argmax(next_scores)  # torch.argmax's result, in two reductions on CUDA
            if has_eos:
                next_tokens = next_tokens * unfinished + pad * (1 - unfinished)
            input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
            unfinished = unfinished & ~stopping_criteria(input_ids, scores)
            step += 1
            checks.append(self._record(step, unfinished, next_tokens if streamer is not None else None))
            at_max = max_length is not None and input_ids.shape[1] >= max_length
            while checks and (len(checks) > lag or at_max):
                done_step, finished = self._read(checks.popleft(), streamer)
                if finished:
                    stop_at = done_step
                    break
            if stop_at is not None or at_max:
                break
            logits = self.patched.controller.decode(self.patched.inner, cache.rows, next_tokens[:, None], positions)
            cache.processed += 1
            positions = positions + 1
        if stop_at is not None and stop_at < step:  # undo the steps run past the stop
            extra = step - stop_at
            input_ids = input_ids[:, :-extra]
            scores = scores[:-extra] if scores is not None else None
            raw_logits = raw_logits[:-extra] if raw_logits is not None else None
            if returned:
                cache.crop(cache.processed - extra)
        self.patched.last_cache = cache
        if streamer is not None:
            streamer.end()
        if not config.return_dict_in_generate:
            return input_ids
        return GenerateDecoderOnlyOutput(sequences=input_ids, scores=scores, logits=raw_logits,
                                         **{_OUTPUT_CACHE_FIELD: cache})

    @staticmethod
    def _record(step: int, unfinished: torch.Tensor, tokens: torch.Tensor | None):
        """Start copying this step's finished flag (and tokens, when a streamer wants them) to the host without
        waiting."""
        pinned = unfinished.device.type == "cuda"
        flag = torch.empty((), dtype=torch.bool, pin_memory=pinned)
        flag.copy_(unfinished.max() == 0, non_blocking=True)
        host_tokens = None
        if tokens is not None:
            host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=pinned)
            host_tokens.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event() if pinned else None
        if event is not None:
            event.record()
        return step, flag, host_tokens, event

    @staticmethod
    def _read(check, streamer) -> tuple[int, bool]:
        step, flag, tokens, event = check
        if event is not None:
            event.synchronize()
        if streamer is not None and tokens is not None:
            streamer.put(tokens.clone())
        return step, bool(flag)

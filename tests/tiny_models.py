"""Tiny random causal LMs (GQA everywhere) for the CPU suite."""

from __future__ import annotations

import copy

import torch
from transformers import AutoConfig, AutoModelForCausalLM

_COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=None,
               tie_word_embeddings=False)

# model_type -> extra config. Small sliding windows make the window masks matter at test lengths.
ARCHITECTURES = {
    "llama": {},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "mistral": {"sliding_window": 9},
    "phi3": {"sliding_window": None},
    "gemma3_text": {"head_dim": 16, "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"],
                    "query_pre_attn_scalar": 16},
}


def tiny_config(model_type: str = "llama", **overrides):
    kwargs = {**_COMMON, **ARCHITECTURES[model_type], **overrides}
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_pair(model_type: str = "llama", seed: int = 0, **overrides):
    """(reference, candidate): two identical tiny models built from separate config objects."""
    torch.manual_seed(seed)
    config = tiny_config(model_type, **overrides)
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()
    candidate = AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()
    candidate.load_state_dict(reference.state_dict())
    return reference, candidate


def left_padded_batch(lengths=(13, 9, 5), vocab: int = 96, seed: int = 1):
    """``input_ids, attention_mask [len(lengths), max]`` with left padding (pad id 0)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids, mask


def word_tokenizer(vocab_size: int = 96):
    """A saveable word-level tokenizer whose ids are the model's ids (``"t17"`` <-> 17), for random models that must
    ship a tokenizer (exported artifacts); prompts are passed as token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="t0", pad_token="t0")

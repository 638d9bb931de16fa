"""The :class:`~sparsecompile.serving.interface.ServedModel` of an HF model patched by ``sparsecompile.optimize()``
(the engine's usual model; ``serving/artifact.py`` is the other one), and the EOS ids a model or tokenizer names."""

from __future__ import annotations

from torch import nn

from ..models.support import UnsupportedModelError


class PatchedServedModel:
    """A patched HF model seen as a :class:`ServedModel`: its controller and inner (patched) forward."""

    def __init__(self, model: nn.Module) -> None:
        # the HF glue (transformers' generation and masking modules: seconds to import) only when a model is
        # served; an exported artifact's engine never imports it
        from ..models.hf_patch import patched_model

        try:
            patched = patched_model(model)
        except ValueError as err:
            raise UnsupportedModelError(f"the serving engine needs a model patched by sparsecompile.optimize(): "
                                        f"{err}") from None
        self.controller = patched.controller
        self.max_length = patched.max_length
        self.inner = patched.inner
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.name = getattr(model.config, "_name_or_path", None) or None
        self.eos_token_ids = eos_token_ids(model, None)


def eos_token_ids(model: nn.Module | None, tokenizer) -> set[int]:
    """Every EOS id the model's generation config and the tokenizer name (either may be None)."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update(value if isinstance(value, (list, tuple)) else [value])
    return ids

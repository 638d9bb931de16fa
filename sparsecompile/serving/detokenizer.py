"""Incremental detokenization and stop conditions of one request.

Decoding a growing token list from scratch every step costs O(n^2) over a request; instead the text is
extended from a short window of recent tokens (``prefix_offset .. read_offset``), which also keeps a
multi-byte character split across tokens out of the text until it is complete. Stop strings are matched
on the text; the returned text ends before the first match, and a streaming client is never sent text
that a stop string might still swallow. Before ``min_tokens`` tokens exist nothing but ``max_tokens`` stops a
request (as vLLM: stop tokens from ``min_tokens`` tokens on, stop strings once there are more). The windows are
decoded by the Rust tokenizer directly where that is the tokenizer's own ``decode`` (:func:`text_decoder`).

The window starts on the prompt's last tokens, as vLLM's: the first generated token is decoded after them, so
a tokenizer that marks a word's leading space in the token (SentencePiece's ``▁``, word-level decoders) gives
``" Paris"`` after ``"The capital of France is"``, not ``"Paris"``, and ``prompt + text`` is the whole
decoded sequence (what ``echo`` returns).
"""

from __future__ import annotations

from collections.abc import Callable

from .outputs import SamplingParams

try:
    from tokenizers import Tokenizer as _RustTokenizer
except ImportError:  # pragma: no cover - transformers requires tokenizers
    _RustTokenizer = None

#: ``decode(ids, skip_special_tokens) -> text``
Decode = Callable[[list[int], bool], str]

_INCOMPLETE = "\ufffd"  # what a tokenizer decodes a partial UTF-8 sequence to
_CONTEXT = 5  # prompt tokens the first window starts on (vLLM's initial incremental detokenization offset)


# Text whose decoding the cleanup transformers can apply after the Rust decoder (clean_up_tokenization_spaces)
# changes, plus what a subclass's own post-processing would likely touch (leading space, special tokens).
_PROBE = " Hello , world . It 's a test ! Is n't it ? I 'm sure we 've seen they 're ' quoted ' here .\n  end"


def _own_decode(tokenizer) -> Decode:
    def slow(ids: list[int], skip_special_tokens: bool) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    return slow


def text_decoder(tokenizer) -> Decode:
    """The tokenizer's ``decode`` as the detokenizer calls it, at the Rust decoder directly when that gives the same
    text: a transformers fast tokenizer whose ``decode`` / ``_decode`` are transformers' own and add no
    post-processing on a probe with every pattern its space cleanup rewrites and the special tokens (transformers'
    Python wrapper costs about half of a token's detokenization: 5.9 -> 2.3-3.1 us a token with SmolLM2's tokenizer
    on this CPU). Any other tokenizer: its own ``decode``. Built once per engine (the probe decodes a few times)."""
    slow = _own_decode(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if _RustTokenizer is None or not isinstance(backend, _RustTokenizer):
        return slow
    for name in ("decode", "_decode"):  # a model's own override could post-process in ways no probe shows
        owner = next((k for k in type(tokenizer).__mro__ if name in vars(k)), None)
        if owner is None or not owner.__module__.startswith("transformers.tokenization_utils"):
            return slow

    def rust(ids: list[int], skip_special_tokens: bool) -> str:
        return backend.decode(ids, skip_special_tokens=skip_special_tokens)

    try:
        specials = list(getattr(tokenizer, "all_special_ids", []))[:4]
        probe = list(tokenizer.encode(_PROBE, add_special_tokens=False)) + specials
        same = all(slow(probe, skip) == rust(probe, skip) for skip in (True, False))
    except Exception:  # noqa: BLE001 - a tokenizer that cannot run the probe keeps its own decode
        return slow
    return rust if same else slow


class Detokenizer:
    """Text and stop state of one request's generated tokens (``decode``: :func:`text_decoder`'s, shared by an
    engine's requests; default the tokenizer's own ``decode``)."""

    def __init__(self, tokenizer, params: SamplingParams, eos_token_ids: set[int],
                 prompt_ids: list[int] = (), decode: Decode | None = None) -> None:
        self._text = decode or _own_decode(tokenizer)
        self.params = params
        self.eos = set() if params.ignore_eos else set(eos_token_ids)
        self.stop_ids = set(params.stop_token_ids)
        self.token_ids: list[int] = []  # generated tokens
        self.text = ""
        self._window = list(prompt_ids[-_CONTEXT:])  # the prompt's tail, then every generated token
        self._prefix_offset = 0
        self._read_offset = len(self._window)
        self._sent = 0  # characters of ``text`` already reported as delta

    def _decode(self, ids: list[int]) -> str:
        return self._text(ids, self.params.skip_special_tokens)

    def append(self, token: int) -> tuple[str | None, str | int | None]:
        """Add one generated token; returns ``(finish_reason, stop_reason)`` (None, None while it goes on)."""
        self.token_ids.append(token)
        self._window.append(token)
        may_stop = len(self.token_ids) >= self.params.min_tokens
        stop_token = may_stop and (token in self.stop_ids or token in self.eos)
        if stop_token:  # its text joins the output only with include_stop_str_in_output (as vLLM)
            if self.params.include_stop_str_in_output:
                self._extend()
            return "stop", token if token in self.stop_ids else None
        start = len(self.text)
        if self._extend() and len(self.token_ids) > self.params.min_tokens:
            for stop in self.params.stop:
                # Only the new text (and what a match could straddle) can hold a new match.
                at = self.text.find(stop, max(0, start - len(stop) + 1))
                if at >= 0:
                    self.text = self.text[:at + len(stop) if self.params.include_stop_str_in_output else at]
                    return "stop", stop
        if len(self.token_ids) >= self.params.max_tokens:
            return "length", None
        return None, None

    def _extend(self) -> bool:
        """Decode the window's new tokens onto ``text``; False while they end in an incomplete character."""
        prefix = self._decode(self._window[self._prefix_offset:self._read_offset])
        full = self._decode(self._window[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(_INCOMPLETE):
            return False
        self.text += full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._window)
        return True

    def delta(self, finished: bool) -> str:
        """Text not reported yet; while running, hold back a tail that could be the start of a stop string (which
        would be cut from the text, unless ``include_stop_str_in_output``)."""
        end = len(self.text)
        if not finished and not self.params.include_stop_str_in_output:
            for stop in self.params.stop:
                for k in range(min(len(stop) - 1, end), 0, -1):
                    if self.text.endswith(stop[:k]):
                        end = min(end, len(self.text) - k)
                        break
        out = self.text[self._sent:end]
        self._sent = max(self._sent, end)
        return out

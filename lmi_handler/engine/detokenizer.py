"""Incremental, UTF-8 safe detokenization: the text each new token adds to a sequence's output.

Owns IncrementalDetokenizer (one per sequence) and per-token prompt texts. Leaves stop strings to
stopping.py (StopStringMatcher) and the choice of which tokens to emit to engine.py.
"""
from __future__ import annotations

# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: how many prompt tokens open the first window.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a sequence's output token ids into text deltas, one decode_next() call per token.

    The vLLM/TGI prefix_offset/read_offset scheme: decode the window ids[prefix_offset:] and
    ids[prefix_offset:read_offset] and return the difference, so a token's leading space and any
    context-dependent decoding survive. While the window ends in U+FFFD (an incomplete multi-byte
    character) the token returns "" and the token that completes the character carries all of it.

    Concatenated deltas == tokenizer.decode(output ids, skip_special_tokens=...) except when the
    output ends in bytes that never form a character (e.g. cut by max_new_tokens mid-emoji): full
    decode shows U+FFFD for them, the deltas hold them back and never emit them (flush() returns the
    complete characters held with them, e.g. a leading space in the same token). Invalid bytes
    followed by more text are emitted as U+FFFD with that text, as full decode does.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.prompt_token_ids = list(prompt_token_ids)
        self._special_ids = _special_ids(tokenizer)
        self._ids = self.prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]   # the prompt tail is context only
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def decode_next(self, token_id: int) -> str:
        """Append one output token; return the new text it completes ("" while a character is incomplete)."""
        self._ids.append(token_id)
        if self.skip_special_tokens and token_id in self._special_ids:
            return ""   # decode would drop it anyway; offsets stay, so the window stays short
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if new_text.endswith(_REPLACEMENT) or len(new_text) <= len(prefix_text):
            return ""   # incomplete UTF-8 at the end: wait for the token that completes it
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._trim()
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """Text still held when the sequence ends (call once, after the last decode_next).

        Returns the held window's complete characters, e.g. the " " of a token " <first bytes of 😀>"
        when max_new_tokens cut the emoji; the trailing U+FFFD of bytes that never formed a character
        are dropped, so deltas + flush() == full decode with its trailing U+FFFD run stripped.
        """
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        self._trim()
        return new_text[len(prefix_text):].rstrip(_REPLACEMENT)

    def is_special(self, token_id: int) -> bool:
        """True for the tokenizer's special tokens (those skip_special_tokens drops)."""
        return token_id in self._special_ids

    def decode_prompt_tokens(self) -> list[str]:
        """Per-token texts of the prompt (LMI decoder_input_details), by the same rules as decode_next."""
        detok = IncrementalDetokenizer(self.tokenizer, [], self.skip_special_tokens)
        return [detok.decode_next(token_id) for token_id in self.prompt_token_ids]

    def _decode(self, ids: list[int]) -> str:
        # the tokenizer's own clean_up_tokenization_spaces default, as the full decode uses
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _trim(self) -> None:
        """Drop ids before the window so memory stays constant over a long generation."""
        if self._prefix_offset > 0:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0


def _special_ids(tokenizer) -> frozenset[int]:
    """Ids decode(skip_special_tokens=True) drops: the named special tokens and added tokens marked special."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return frozenset(tokenizer.all_special_ids) | frozenset(i for i, tok in added.items() if tok.special)

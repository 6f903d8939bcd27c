"""Reasoning output (option.reasoning_parser, vLLM's names): a reasoning model's `<think>...</think>` text split
from its answer, whole or as the text streams in.

Owns the split; where the parts go in a response (`reasoning_content`, `content`) is chat_output.py's.
"""
from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"
# deepseek_r1: DeepSeek-R1 and its distills; their chat template opens <think> in the prompt, so the output starts
# inside the reasoning (a leading <think> is dropped) and text with no </think> is all reasoning (vLLM).
# qwen3: Qwen3 opens <think> in the output; text that does not start with it is all answer (enable_thinking=false).
REASONING_PARSERS = ("deepseek_r1", "qwen3")


class ReasoningSplitter:
    """Splits growing text into (reasoning, answer) pieces: feed() each new piece, finish() once at the end.

    The tags never reach either part. A piece that may be the start of a tag is held back until the next
    piece (or the end) decides it, so every split of a text into pieces gives the same parts.
    """

    def __init__(self, parser: str):
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}, got {parser!r}")
        self.parser = parser
        self.text = ""
        self.pos = 0                    # characters of text handed out (or dropped as tags)
        self.state = "start"            # start -> reasoning -> answer, or start -> answer (qwen3)

    def feed(self, text: str) -> tuple[str, str]:
        self.text += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning = answer = ""
        while True:
            if self.state == "start":
                rest = self.text[self.pos:]
                stripped = rest.lstrip()
                if stripped.startswith(THINK_START):
                    self.pos += len(rest) - len(stripped) + len(THINK_START)
                    self.state = "reasoning"
                elif not final and THINK_START.startswith(stripped):
                    return reasoning, answer          # still maybe <think>: wait
                else:
                    self.state = "reasoning" if self.parser == "deepseek_r1" else "answer"
            elif self.state == "reasoning":
                end = self.text.find(THINK_END, self.pos)
                if end >= 0:
                    reasoning += self.text[self.pos:end]
                    self.pos, self.state = end + len(THINK_END), "answer"
                    continue
                safe = len(self.text) if final else max(self.pos, held_back(self.text, THINK_END))
                reasoning += self.text[self.pos:safe]
                self.pos = safe
                return reasoning, answer
            else:
                answer += self.text[self.pos:]
                self.pos = len(self.text)
                return reasoning, answer


def held_back(text: str, marker: str) -> int:
    """Where text may go out for now: before a suffix of `text` that may be the start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return len(text) - size
    return len(text)

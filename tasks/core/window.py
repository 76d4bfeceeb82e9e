"""The prompt window: where a long prefix is cut so that successive requests of a typing session share their
prompt's start (vLLM's prefix cache reuses their KV). The gateway, the evaluation and training cut the same way."""

from __future__ import annotations

import hashlib


def window_prefix(prefix: str, max_chars: int, step_chars: int) -> str:
    """The end of prefix a prompt keeps: all of it when it fits in max_chars, else from an anchor line on.

    A KV cache (vLLM's prefix caching) is reused only when successive prompts start with the same text, so
    the cut must not slide with the cursor. Editors send prefixes that slide themselves (the last N characters
    or lines before the cursor), so the anchor cannot be a fixed offset from the prefix's start; it is chosen
    by the text (winnowing): of the line starts in the first step_chars characters of the window, the one whose
    preceding line (complete, so typing never changes it) hashes lowest. It stays the cut while the user
    types, until it leaves that stretch or a line with a lower hash enters it: about every step_chars / 2
    characters typed, whatever the prefix's own start. With no line start in the stretch, the last max_chars
    characters. Deterministic: the gateway, the evaluation and training (reading the prompts the gateway
    logged) cut the same text the same way."""
    if len(prefix) <= max_chars:
        return prefix
    lo = len(prefix) - max_chars
    if step_chars <= 0:  # no anchor: the window slides with the cursor
        return prefix[lo:]
    best, best_hash = -1, 2.0
    start = prefix.find("\n", lo - 1) + 1
    while 0 < start < min(lo + step_chars, len(prefix)):
        line = prefix[prefix.rfind("\n", 0, start - 1) + 1 : start]  # the complete line before `start`
        if (h := _unit_hash(line)) < best_hash:
            best, best_hash = start, h
        start = prefix.find("\n", start) + 1
    return prefix[best:] if best >= 0 else prefix[lo:]


def _unit_hash(text: str) -> float:
    """A number in [0, 1) from the text (the same in every process and on every machine)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") / 2**64

"""What each user typed after a request: read from their next requests' prefixes.

An editor asks at every pause, and each request carries the text before the cursor. So a user's next
request in the same document tells what they typed in between: its prefix is this one's followed by
the typed text (both cut from the left when the editor caps the prefix). Chained over the user's later
requests, that is the continuation of every request: what a right suggestion would have been. After a
Tab the next prefix holds the suggestion, so an accepted suggestion is the start of its continuation.

Two requests are in the same document when the text after the cursor (the suffix, which typing does not
change) is equal and the later prefix starts with a long enough tail of the earlier one (``MIN_ANCHOR``
characters, or the whole earlier prefix). A deletion, a jump elsewhere or another file breaks the chain:
the continuation of the request before the break is what was typed up to it, and a request with no later
one in its document has none (null).
"""

from __future__ import annotations

from collections.abc import Sequence

# The shortest overlap that counts as "the same text, typed on": a short one (a few blanks, a bracket)
# matches by chance after a deletion or a jump; 32 characters are a line's worth of context.
MIN_ANCHOR = 32


def typed_between(prefix: str, later: str) -> str | None:
    """The text typed between a request with ``prefix`` and a later one with prefix ``later``, or None.

    ``later`` must be ``prefix`` (perhaps cut from the left) followed by the typed text: the longest head of
    ``later`` that is a tail of ``prefix`` is taken as the overlap."""
    for k in range(min(len(later), len(prefix)), 0, -1):
        if prefix.endswith(later[:k]):
            return later[k:] if k >= min(MIN_ANCHOR, len(prefix)) else None
    return later if not prefix else None


def continuations(
    users: Sequence[str], prefixes: Sequence[str | None], suffixes: Sequence[str | None], max_chars: int
) -> list[str | None]:
    """Per request (rows in the order they were served): what its user typed next, at most max_chars (None:
    unknown). Rows without a prefix or suffix (snapshots written before they were logged) have none."""
    n = len(users)
    typed: list[str | None] = [None] * n  # typed[i]: text typed between row i and its user's next row
    nxt: list[int | None] = [None] * n
    last: dict[str, int] = {}
    for j in range(n):
        if prefixes[j] is None or suffixes[j] is None:
            continue
        i = last.get(users[j])
        if i is not None and suffixes[i] == suffixes[j]:
            piece = typed_between(prefixes[i], prefixes[j])
            if piece is not None:
                typed[i], nxt[i] = piece, j
        last[users[j]] = j
    out: list[str | None] = [None] * n
    for i in range(n - 1, -1, -1):
        if typed[i] is None:
            continue
        rest = out[nxt[i]] or ""
        out[i] = (typed[i] + rest)[:max_chars]
    return out

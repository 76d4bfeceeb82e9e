"""Cleaning: which decided interactions may reach a training set, each rule counted.

Rules, applied in this order; a dropped row is counted under the first rule that drops it:

    not_trainable   the client marked the outcome as not for training (e.g. Continue's noCode level);
                    the outcome still counts in the cycle's stats
    opted_out       the user opted out (``users.opted_out``)
    too_long        prompt longer than ingest.max_prompt_chars or completion than max_completion_chars
    duplicate       same (user, prompt, completion) as an earlier row of the cycle (keyed by the store's
                    prompt_hash = sha256(prompt, NUL, completion), so the texts are not hashed again)
    secret          a detect-secrets detector fires on a line of the prompt or the completion
    per_user_cap    the user already has ingest.per_user_cap rows in the cycle (first ones by seq kept)

State lives in one ``Cleaner`` per cycle, so rows can be fed in chunks (bounded memory: a 64-bit
key per kept row for duplicates, a count per user, a bounded cache of clean lines).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class
from detect_secrets.plugins.base import RegexBasedDetector

from tasks.core.config import IngestParams

RULES = ("not_trainable", "opted_out", "too_long", "duplicate", "secret", "per_user_cap")


class SecretScanner:
    """detect-secrets' detectors, line by line (as the tool scans files), with a cache of clean lines.

    Speed without changing the verdict: the new (uncached) lines of a batch are joined and each
    detector's own patterns are searched once over the whole text (with MULTILINE, so every match
    a pattern has inside one line is also found there); only the lines a match touches are then
    scanned line by line by the plugins themselves, which decides.
    """

    def __init__(self, detectors: tuple[str, ...], cache_lines: int) -> None:
        by_name = {cls.__name__: cls for cls in get_mapping_from_secret_type_to_class().values()}
        unknown = [name for name in detectors if name not in by_name]
        if unknown:
            raise ValueError(
                f"ingest.secret_detectors: unknown detect-secrets plugin(s) {unknown}; known: {sorted(by_name)}"
            )
        self.plugins = [by_name[name]() for name in detectors]
        missing = [type(p).__name__ for p in self.plugins if not isinstance(p, RegexBasedDetector)]
        if missing:
            raise ValueError(
                f"ingest.secret_detectors: {missing} are not pattern detectors (entropy/keyword ones are not supported)"
            )
        self._patterns = [re.compile(r.pattern, r.flags | re.MULTILINE) for p in self.plugins for r in p.denylist]
        self.cache_lines = cache_lines
        self._clean: set[str] = set()

    def line_types(self, line: str) -> list[str]:
        """The verdict on one line: the secret types detect-secrets' plugins find in it."""
        return [p.secret_type for p in self.plugins if next(iter(p.analyze_string(line)), None) is not None]

    def secret_types(self, text: str) -> list[str]:
        """Secret types found in one text (empty when clean)."""
        return [t for line in self._with_secrets(text.splitlines()) for t in self.line_types(line)]

    def flag(self, texts: list[str]) -> list[bool]:
        """For each text: does any of its lines hold a secret?"""
        split = [text.splitlines() for text in texts]
        bad = self._with_secrets(set().union(*split))
        if not bad:
            return [False] * len(texts)
        return [not bad.isdisjoint(lines) for lines in split]

    def _with_secrets(self, lines: Iterable[str]) -> set[str]:
        clean = self._clean
        new = set(lines) - clean
        if not new or not self.plugins:
            return set()
        bad = {line for line in self._touched(sorted(new)) if self.line_types(line)}
        if self.cache_lines:
            if len(clean) + len(new) > self.cache_lines:
                clean.clear()  # bounded: forget everything rather than track recency
            clean.update(new - bad)
        return bad

    def _touched(self, lines: list[str]) -> list[str]:
        """Lines that a detector pattern matches in (or across) when they are searched as one text."""
        text = "\n".join(lines)
        starts = list(itertools.accumulate((len(line) + 1 for line in lines[:-1]), initial=0))
        touched: set[int] = set()
        for pattern in self._patterns:
            pos = 0
            while (match := pattern.search(text, pos)) is not None:
                first = bisect.bisect_right(starts, match.start()) - 1
                last = bisect.bisect_right(starts, max(match.end() - 1, match.start())) - 1
                touched.update(range(first, last + 1))
                if first + 1 >= len(starts):
                    break
                pos = starts[first + 1]  # resume at the next line: a long match hides none of its own lines' matches
        return [lines[i] for i in sorted(touched)]


@dataclass
class Cleaner:
    """Decides row by row; ``report`` counts rows seen, kept and dropped per rule."""

    params: IngestParams
    scanner: SecretScanner = field(init=False)
    report: dict[str, int] = field(init=False)
    _seen: set[int] = field(init=False, default_factory=set)
    _per_user: dict[str, int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.scanner = SecretScanner(self.params.secret_detectors, self.params.secret_cache_lines)
        self.report = {"rows_in": 0, **{rule: 0 for rule in RULES}, "rows_out": 0}

    def _cheap_rule(
        self,
        user_id: str,
        prompt: str,
        completion: str,
        trainable: bool,
        opted_out: bool,
        prompt_hash: str | None = None,
    ) -> str | None:
        if not trainable:
            return "not_trainable"
        if opted_out:
            return "opted_out"
        if len(prompt) > self.params.max_prompt_chars or len(completion) > self.params.max_completion_chars:
            return "too_long"
        key = _row_key(user_id, prompt_hash or text_hash(prompt, completion))
        if key in self._seen:
            return "duplicate"
        self._seen.add(key)
        return None

    def keep_mask(self, rows: list[tuple]) -> list[bool]:
        """For (user_id, prompt, completion, trainable, opted_out[, prompt_hash]) rows in seq order: keep each one?

        ``prompt_hash`` is the log store's ``completions.prompt_hash`` (``text_hash``), computed here when absent.
        """
        self.report["rows_in"] += len(rows)
        verdict: list[str | None] = [self._cheap_rule(*row) for row in rows]
        todo = [i for i, rule in enumerate(verdict) if rule is None]
        prompts = self.scanner.flag([rows[i][1] for i in todo])
        completions = self.scanner.flag([rows[i][2] for i in todo])
        for i, in_prompt, in_completion in zip(todo, prompts, completions, strict=True):
            user = rows[i][0]
            if in_prompt or in_completion:
                verdict[i] = "secret"
            elif self._per_user.get(user, 0) >= self.params.per_user_cap:
                verdict[i] = "per_user_cap"
            else:
                self._per_user[user] = self._per_user.get(user, 0) + 1
        for rule in verdict:
            self.report[rule or "rows_out"] += 1
        return [rule is None for rule in verdict]

    def keep(self, user_id: str, prompt: str, completion: str, trainable: bool = True, opted_out: bool = False) -> bool:
        return self.keep_mask([(user_id, prompt, completion, trainable, opted_out)])[0]


def text_hash(prompt: str, completion: str) -> str:
    """The log store's ``prompt_hash``: sha256 of prompt, NUL, completion."""
    return hashlib.sha256(f"{prompt}\0{completion}".encode("utf-8", "surrogatepass")).hexdigest()


def _row_key(user_id: str, prompt_hash: str) -> int:
    """64 bits of blake2b over (user, sha256 of the texts): a collision among a cycle's rows is ~n^2/2^65."""
    digest = hashlib.blake2b(f"{len(user_id)}:{user_id}:{prompt_hash}".encode("utf-8", "surrogatepass"), digest_size=8)
    return int.from_bytes(digest.digest(), "big")

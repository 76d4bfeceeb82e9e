"""Cleaning: which decided interactions may reach a training set, each rule counted.

Rules, applied in this order; a dropped row is counted under the first rule that drops it:

    not_trainable   the client marked the outcome as not for training (e.g. Continue's noCode level);
                    the outcome still counts in the cycle's stats
    opted_out       the user opted out (``users.opted_out``)
    too_long        prompt longer than ingest.max_prompt_chars or completion than max_completion_chars
    duplicate       same (user, prompt, completion) as an earlier row of the cycle
    secret          a detect-secrets detector fires on a line of the prompt or the completion
    per_user_cap    the user already has ingest.per_user_cap rows in the cycle (first ones by seq kept)

State lives in one ``Cleaner`` per cycle, so rows can be fed in chunks (bounded memory: a 64-bit
key per kept row for duplicates, a count per user, a bounded cache of clean lines).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class

from tasks.config import IngestParams

RULES = ("not_trainable", "opted_out", "too_long", "duplicate", "secret", "per_user_cap")


class SecretScanner:
    """detect-secrets' detectors, line by line (as the tool scans files), with a cache of clean lines."""

    def __init__(self, detectors: tuple[str, ...], cache_lines: int) -> None:
        by_name = {cls.__name__: cls for cls in get_mapping_from_secret_type_to_class().values()}
        unknown = [name for name in detectors if name not in by_name]
        if unknown:
            raise ValueError(f"ingest.secret_detectors: unknown detect-secrets plugin(s) {unknown}; known: {sorted(by_name)}")
        self.plugins = [by_name[name]() for name in detectors]
        self.cache_lines = cache_lines
        self._clean: set[str] = set()

    def secret_types(self, text: str) -> list[str]:
        """Secret types found in text (empty when clean)."""
        found: list[str] = []
        for line in text.splitlines():
            if line in self._clean:
                continue
            hits = [p.secret_type for p in self.plugins if next(iter(p.analyze_string(line)), None) is not None]
            if hits:
                found.extend(hits)
            elif self.cache_lines:
                if len(self._clean) >= self.cache_lines:
                    self._clean.clear()  # bounded: forget everything rather than track recency
                self._clean.add(line)
        return found


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

    def rule_for(self, user_id: str, prompt: str, completion: str, trainable: bool, opted_out: bool) -> str | None:
        """The rule that drops this row, or None to keep it (and count it against the user's cap)."""
        if not trainable:
            return "not_trainable"
        if opted_out:
            return "opted_out"
        if len(prompt) > self.params.max_prompt_chars or len(completion) > self.params.max_completion_chars:
            return "too_long"
        key = _row_key(user_id, prompt, completion)
        if key in self._seen:
            return "duplicate"
        self._seen.add(key)
        if self.scanner.secret_types(prompt) or self.scanner.secret_types(completion):
            return "secret"
        if self._per_user.get(user_id, 0) >= self.params.per_user_cap:
            return "per_user_cap"
        self._per_user[user_id] = self._per_user.get(user_id, 0) + 1
        return None

    def keep(self, user_id: str, prompt: str, completion: str, trainable: bool = True, opted_out: bool = False) -> bool:
        self.report["rows_in"] += 1
        rule = self.rule_for(user_id, prompt, completion, trainable, opted_out)
        if rule is None:
            self.report["rows_out"] += 1
            return True
        self.report[rule] += 1
        return False


def _row_key(user_id: str, prompt: str, completion: str) -> int:
    """64 bits of blake2b over the exact texts: a collision among a cycle's rows is ~n^2/2^65."""
    digest = hashlib.blake2b(digest_size=8)
    for part in (user_id, prompt, completion):
        data = part.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "big"))  # length-prefixed: no two splits hash alike
        digest.update(data)
    return int.from_bytes(digest.digest(), "big")

"""Judges that score a completion 0-10: an LLM behind any OpenAI-compatible endpoint, or the reference.

The LLM judge follows RLinf's scheme: a code reviewer scores the correctness and functionality of
the completion between ``<prefix>`` and ``<suffix>`` on five levels (0, 3, 6, 8, 10) and answers

    <evaluation><score>N</score><justification>...</justification></evaluation>

at temperature 0. Parsing is strict: an answer without exactly one such block, one integer score
on a level and a justification leaves the sample *unscored* (counted and reported, never a
default score).

Resilience is declared, not looped: the ``openai`` client retries 408/409/429/5xx, connection
errors and timeouts with exponential backoff (honouring ``Retry-After``) up to
``judge.max_retries`` times, each attempt bounded by ``judge.timeout_s``; an ``asyncio``
semaphore keeps ``judge.concurrency`` requests in flight. Answers that parse are cached in SQLite
keyed by (judge model, sha256 of the prompt), so re-evaluating costs nothing; errors and
malformed answers are never cached. When the endpoint stays down (retries exhausted),
``judge.on_failure`` decides: ``fail`` raises ``JudgeUnavailable``; ``reference`` re-scores the
whole batch with the reference judge (never a mix of judges in one comparison). A rejected
request (400/401/404...) is a configuration error and always raises.

Empty completions (abstentions) are not sent to any judge: there is nothing to score.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import openai
from tqdm import tqdm

from tasks.core.config import JudgeParams
from tasks.evaluate.reference import LEVELS, checks, reference_score

log = logging.getLogger(__name__)

JUDGE_PROMPT = """\
You are an expert code reviewer. A code-completion model saw the code before the cursor (<prefix>) \
and the code after it (<suffix>) and proposed the text to insert between them (<completion>). \
Evaluate the correctness and functionality of the completion in its place: with it inserted, is \
the code correct and working, and is it what a competent developer would write there?

Score on exactly one of these levels:
10 - correct and complete: fits the prefix and suffix exactly and does what the code needs.
8 - correct with minor issues: works, but a detail is unidiomatic, redundant or slightly incomplete.
6 - partially correct: on the right track, but incomplete or with an error that is easy to fix.
3 - mostly incorrect: related to the context, but with wrong logic, wrong names or broken syntax.
0 - wrong: irrelevant to the context, or it breaks the code.

<prefix>
{prefix}
</prefix>
<suffix>
{suffix}
</suffix>
<completion>
{completion}
</completion>

Answer with exactly this XML block and nothing else:
<evaluation>
<score>N</score>
<justification>one or two sentences</justification>
</evaluation>
where N is one of 0, 3, 6, 8, 10."""

_EVALUATION = re.compile(r"<evaluation>(.*?)</evaluation>", re.DOTALL)
_SCORE = re.compile(r"<score>(.*?)</score>", re.DOTALL)
_JUSTIFICATION = re.compile(r"<justification>(.*?)</justification>", re.DOTALL)
_INTEGER = re.compile(r"\s*(\d{1,2})\s*")


class JudgeError(RuntimeError):
    """The judge cannot be used as configured (missing key, request rejected); always fatal."""


class JudgeUnavailable(JudgeError):
    """The judge endpoint stayed down (connection, timeout, 429, 5xx) after the declared retries."""


@dataclass(frozen=True)
class Verdict:
    score: int | None  # one of LEVELS; None = unscored
    note: str  # the judge's justification, or why the answer could not be scored


@dataclass(frozen=True)
class JudgeRun:
    judge: str  # "llm:<model>", "reference", or "reference (fallback: <why>)"
    verdicts: list[Verdict | None]  # one per (sample, completion); None where the completion is empty
    requests: int = 0  # prompts sent to the endpoint (after de-duplication and cache hits)
    cache_hits: int = 0


def judge_prompt(prefix: str, suffix: str, completion: str) -> str:
    return JUDGE_PROMPT.format(prefix=prefix, suffix=suffix, completion=completion)


def parse_verdict(answer: str) -> Verdict:
    """Strictly parse an answer; anything but one well-formed block with a level is unscored."""
    blocks = _EVALUATION.findall(answer)
    if len(blocks) != 1:
        return Verdict(None, f"unscored: expected one <evaluation> block, found {len(blocks)}")
    scores = _SCORE.findall(blocks[0])
    if len(scores) != 1:
        return Verdict(None, f"unscored: expected one <score> in <evaluation>, found {len(scores)}")
    number = _INTEGER.fullmatch(scores[0])
    if number is None or int(number.group(1)) not in LEVELS:
        return Verdict(None, f"unscored: score {scores[0].strip()!r} is not one of {LEVELS}")
    justifications = _JUSTIFICATION.findall(blocks[0])
    if len(justifications) != 1 or not justifications[0].strip():
        return Verdict(None, "unscored: expected one non-empty <justification>")
    return Verdict(int(number.group(1)), justifications[0].strip())


class JudgeCache:
    """Answers that parsed, keyed by (judge model, sha256 of the prompt), in one SQLite file."""

    def __init__(self, path: str | Path):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path)
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS judge_answers (model TEXT NOT NULL, prompt_sha256 TEXT NOT NULL, "
            "answer TEXT NOT NULL, created_at REAL NOT NULL, PRIMARY KEY (model, prompt_sha256))"
        )
        self._db.commit()

    @staticmethod
    def key(prompt: str) -> str:
        return hashlib.sha256(prompt.encode()).hexdigest()

    def get(self, model: str, prompt: str) -> str | None:
        row = self._db.execute(
            "SELECT answer FROM judge_answers WHERE model = ? AND prompt_sha256 = ?", (model, self.key(prompt))
        ).fetchone()
        return row[0] if row else None

    def put(self, model: str, prompt: str, answer: str) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO judge_answers VALUES (?, ?, ?, ?)", (model, self.key(prompt), answer, time.time())
        )
        self._db.commit()

    def close(self) -> None:
        self._db.close()


def _api_key(params: JudgeParams) -> str:
    key = os.environ.get(params.api_key_env)
    if not key:
        raise JudgeError(
            f"the LLM judge needs an API key in ${params.api_key_env} (evaluate.judge.api_key_env); "
            "set it (any non-empty value for a local endpoint) or use evaluate.judge.kind=reference"
        )
    return key


async def _ask(client: openai.AsyncOpenAI, prompt: str, params: JudgeParams) -> str:
    """One chat completion; retries and timeouts are the client's (declared at construction)."""
    try:
        response = await client.chat.completions.create(
            model=params.model,
            messages=[{"role": "user", "content": prompt}],
            temperature=0.0,
        )
    except (openai.APIConnectionError, openai.RateLimitError, openai.InternalServerError) as err:
        # APITimeoutError is an APIConnectionError; all of these were already retried by the client.
        raise JudgeUnavailable(
            f"judge {params.model} at {params.base_url} unavailable after {params.max_retries} retries: "
            f"{type(err).__name__}: {err}"
        ) from err
    except openai.APIStatusError as err:
        raise JudgeError(f"judge {params.model} at {params.base_url} rejected the request: {err}") from err
    if not response.choices:
        return ""
    return response.choices[0].message.content or ""


async def _ask_all(prompts: Sequence[str], params: JudgeParams, cache: JudgeCache) -> dict[str, str]:
    """Answers for distinct prompts; each parsed answer is cached as soon as it arrives."""
    answers: dict[str, str] = {}
    if not prompts:
        return answers
    api_key = _api_key(params)
    limit = asyncio.Semaphore(params.concurrency)
    bar = tqdm(total=len(prompts), desc=f"judge {params.model}", unit="req")
    async with openai.AsyncOpenAI(
        base_url=params.base_url,
        api_key=api_key,
        timeout=params.timeout_s,
        max_retries=params.max_retries,
    ) as client:

        async def one(prompt: str) -> None:
            async with limit:
                answer = await _ask(client, prompt, params)
            answers[prompt] = answer
            if parse_verdict(answer).score is not None:
                cache.put(params.model, prompt, answer)
            bar.update()

        tasks = [asyncio.create_task(one(p)) for p in prompts]
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)  # let the cancellations finish
    bar.close()
    # Read every finished task's exception, not only the first: one left unread is logged with its
    # traceback when the task is garbage-collected, at any later moment, and on Python 3.11 that
    # formatting can run ast.parse inside another ast.parse (SystemError: AST constructor recursion
    # depth mismatch, seen in an unrelated test).
    failures = [err for err in (task.exception() for task in done) if err is not None]
    if failures:
        raise failures[0]
    return answers


def llm_judge(pairs: Sequence[tuple[dict, str]], params: JudgeParams) -> JudgeRun:
    """Score (sample, completion) pairs with the LLM judge; raises JudgeUnavailable when it is down."""
    prompts = [judge_prompt(s["prefix"], s["suffix"], c) if c.strip() else None for s, c in pairs]
    cache = JudgeCache(params.cache_path)
    try:
        known = {p: cache.get(params.model, p) for p in dict.fromkeys(p for p in prompts if p is not None)}
        missing = [p for p, answer in known.items() if answer is None]
        known.update(asyncio.run(_ask_all(missing, params, cache)))
    finally:
        cache.close()
    verdicts = [parse_verdict(known[p]) if p is not None else None for p in prompts]
    return JudgeRun(f"llm:{params.model}", verdicts, requests=len(missing), cache_hits=len(known) - len(missing))


def reference_judge(pairs: Sequence[tuple[dict, str]]) -> JudgeRun:
    """Score (sample, completion) pairs from the true middles (see tasks/evaluate/reference.py)."""
    verdicts = [Verdict(reference_score(checks(s, c)), "reference") if c.strip() else None for s, c in pairs]
    return JudgeRun("reference", verdicts)


def judge(pairs: Sequence[tuple[dict, str]], params: JudgeParams) -> JudgeRun:
    """The judge the params choose, with the declared fallback when the LLM endpoint is down."""
    if params.kind == "reference":
        return reference_judge(pairs)
    try:
        return llm_judge(pairs, params)
    except JudgeUnavailable as err:
        if params.on_failure == "fail":
            raise
        log.warning("LLM judge down, scoring every completion with the reference judge instead: %s", err)
        run = reference_judge(pairs)
        return JudgeRun(f"reference (fallback: {err})", run.verdicts)

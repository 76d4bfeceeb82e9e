"""The reference judge: a deterministic 0-10 score of a completion from the true middle (offline).

Checks computed for every sample (they are also the reference metrics of an evaluation):

* ``exact``: the completion equals the middle, trailing whitespace aside (invisible in an editor);
* ``same_code``: equal after collapsing whitespace runs (``tasks.sim.users.normalise``);
* ``prefix``: the normalised completion is a prefix of the normalised middle covering at least
  half of its non-blank characters (a right start that does real work; what a simulated user
  would take with Tab);
* ``edit_sim``: ``difflib`` similarity ratio of completion and middle, in [0, 1];
* ``parse_ok``: for Python files whose original ``prefix + middle + suffix`` parses with ``ast``,
  whether ``prefix + completion + suffix`` still parses; ``None`` when the check does not apply
  (other languages, or a window cut so the original does not parse either).

The score, on the LLM judge's levels (first rule that holds wins):

    10  exact
     8  same code up to whitespace and not breaking the parse, or edit_sim >= 0.8 and not breaking it
     6  a right start (prefix, short of the whole middle: it need not parse yet), or edit_sim >= 0.5
        and not breaking the parse
     3  edit_sim >= 0.3, or same code / edit_sim >= 0.5 that breaks the parse
     0  anything else

"Breaking the parse" means ``parse_ok is False``. An empty completion (abstain) is not scored:
there is no code to judge, and abstaining is priced by the reward per request instead.
"""

from __future__ import annotations

import ast
import difflib
import warnings
from dataclasses import dataclass

from tasks.sim.users import nonblank, normalise

LEVELS = (0, 3, 6, 8, 10)
# Similarity thresholds of the mapping above (documented in the module docstring).
SIM_NEAR, SIM_PARTIAL, SIM_RELATED = 0.8, 0.5, 0.3
PREFIX_COVER = 0.5  # share of the middle's non-blank characters a right start must cover
PARSED_SUFFIXES = (".py", ".pyi")


@dataclass(frozen=True)
class Checks:
    exact: bool
    same_code: bool
    prefix: bool
    edit_sim: float
    parse_ok: bool | None  # None: the parse check does not apply to this sample


def parses(source: str) -> bool:
    """Whether Python source compiles to an AST (warnings about escapes etc. are not failures)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            ast.parse(source)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            # ValueError: null bytes; RecursionError/MemoryError: pathological nesting in the window.
            return False
    return True


def edit_similarity(a: str, b: str) -> float:
    if not a and not b:
        return 1.0
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def checks(sample: dict, completion: str) -> Checks:
    """The reference checks of one completion against the sample's true middle."""
    middle = sample["middle"]
    shown, truth = normalise(completion), normalise(middle)
    parse_ok = None
    if str(sample.get("path", "")).endswith(PARSED_SUFFIXES) and completion.strip():
        if parses(sample["prefix"] + middle + sample["suffix"]):
            parse_ok = parses(sample["prefix"] + completion + sample["suffix"])
    return Checks(
        exact=completion.rstrip() == middle.rstrip() and bool(completion.strip()),
        same_code=bool(shown) and shown == truth,
        prefix=bool(shown) and truth.startswith(shown) and nonblank(shown) >= PREFIX_COVER * nonblank(truth),
        edit_sim=edit_similarity(completion, middle),
        parse_ok=parse_ok,
    )


def reference_score(c: Checks) -> int:
    """Map the checks of a non-empty completion onto the levels 0/3/6/8/10 (module docstring)."""
    keeps_parse = c.parse_ok is not False
    if c.exact:
        return 10
    if (c.same_code or c.edit_sim >= SIM_NEAR) and keeps_parse:
        return 8
    if (c.prefix and not c.same_code) or (c.edit_sim >= SIM_PARTIAL and keeps_parse):
        return 6
    if c.edit_sim >= SIM_RELATED or c.same_code:
        return 3
    return 0

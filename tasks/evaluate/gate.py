"""The gate a candidate must pass before it reaches any user.

It passes only if, against the champion on the same held-out traffic and judge,

* neither reward per request (editor traffic) nor judge mean drops by more than the tolerance
  (``gate_tolerance`` for reward, 10x that for the 0-10 judge mean), and
* characters saved (editor traffic) do not drop by more than ``chars_saved_tolerance`` (relative) below
  the champion's, nor below its lineage's best (``chars_mark``: the characters saved, on the same requests,
  of the ancestor that saved the most at the gates along the lineage, the registered champion's
  ``tabrl.chars_saved_holder``; so drops within the tolerance cannot add up over cycles): a policy
  that raises its accept rate by showing less while saving users fewer characters is reward
  hacking (GitHub found accept rate alone favours short, simple suggestions). Relative, because the
  level depends on the code: the tiny base saves ~2 % of the characters of held-out standard-library
  files and ~0.3 % of third-party ones, where an absolute tolerance of a few tenths of a point let the
  loop give up two thirds of its saved characters (docs/lab, "Held-out code unlike the
  traffic"); and
* at least one of them improves by the margin (``gate_margin``, 10x for the judge mean) and by
  more than zero: equal is not better, whatever the margin;
* and the candidate has judge evidence (at least one scored suggestion): no gate passes on no
  evidence. A champion with no scored suggestion (it showed nothing) has no judge mean to drop
  from: the judge mean is then not compared, and the improvement must come from reward.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from tasks.core.config import EvaluateParams

T = TypeVar("T")

REWARD, JUDGE, SCORED = "eval/typing/reward_per_request", "eval/judge_mean", "eval/judge_scored"
CHARS = "eval/typing/chars_saved"
JUDGE_SCALE = 10.0  # the judge mean is on 0-10, reward per request on roughly -1..1


@dataclass(frozen=True)
class GateDecision:
    passed: bool
    reasons: list[str]
    numbers: dict[str, float] = field(default_factory=dict)
    mark_held_by: str = "champion"
    """Who holds the lineage's characters-saved mark if the candidate is promoted: "candidate", "champion" or
    "lineage" (the ancestor that held it before)."""

    def mark_holder_after(self, champion: T, lineage: T | None) -> T | None:
        """The holder a promoted candidate names (`mark_held_by`, given the champion and the lineage's holder as
        the caller knows them: a registry version, a directory); None when the candidate holds it itself."""
        return {"champion": champion, "lineage": lineage}.get(self.mark_held_by)


def _chars_saved(
    candidate: Mapping[str, float],
    champion: Mapping[str, float],
    chars_mark: float | None,
    params: EvaluateParams,
    numbers: dict[str, float],
    reasons: list[str],
) -> tuple[bool, str]:
    """The characters-saved check against the lineage's mark (its numbers and reason added to the gate's): whether
    the candidate stays above the floor, and who holds the mark if it is promoted."""
    cand, champ = float(candidate[CHARS]), float(champion[CHARS])
    mark = champ if chars_mark is None else max(champ, float(chars_mark))
    floor = mark * (1.0 - params.chars_saved_tolerance)
    numbers.update(
        {
            "candidate/chars_saved": cand,
            "champion/chars_saved": champ,
            "delta/chars_saved": cand - champ,
            "tolerance/chars_saved": params.chars_saved_tolerance,
            "mark/chars_saved": mark,
            "floor/chars_saved": floor,
            "mark_after/chars_saved": max(mark, cand),
        }
    )
    against = f"{champ:.4f}" if mark == champ else f"the lineage's best {mark:.4f}; champion {champ:.4f}"
    change = f"{cand - mark:+.4f} ({cand:.4f} vs {against})"
    if cand < floor:
        reasons.append(
            f"chars_saved drops {change}, below {floor:.4f} ({params.chars_saved_tolerance:.0%} tolerance): "
            "users would type more themselves"
        )
    else:
        reasons.append(
            f"chars_saved changes {change}: not below {floor:.4f} ({params.chars_saved_tolerance:.0%} tolerance)"
        )
    held_by = "candidate" if cand >= mark else "champion" if mark == champ else "lineage"
    return not cand < floor, held_by  # not `>=`: a NaN count stays no drop, as the check below the floor reads


def gate(
    candidate: Mapping[str, float],
    champion: Mapping[str, float],
    params: EvaluateParams,
    chars_mark: float | None = None,
) -> GateDecision:
    """Decide from two metric dicts (``EvalResult.metrics``) whether the candidate may go to users.

    chars_mark: the characters saved on the same held-out traffic by the ancestor holding the champion's
    lineage mark (None: the champion holds it). ``numbers["mark_after/chars_saved"]`` and ``mark_held_by``
    say the mark a promoted candidate carries on, and whose it is."""
    numbers: dict[str, float] = {}
    reasons: list[str] = []
    no_drop, improved = True, False
    champion_judged = float(champion[SCORED]) > 0
    for name, scale in ((REWARD, 1.0), (JUDGE, JUDGE_SCALE)):
        cand, champ = float(candidate[name]), float(champion[name])
        delta, tolerance, margin = cand - champ, params.gate_tolerance * scale, params.gate_margin * scale
        short = name.rsplit("/", 1)[-1]
        numbers.update(
            {
                f"candidate/{short}": cand,
                f"champion/{short}": champ,
                f"delta/{short}": delta,
                f"tolerance/{short}": tolerance,
                f"margin/{short}": margin,
            }
        )
        if name == JUDGE and not champion_judged:
            reasons.append("judge mean not compared: the champion has no scored suggestion")
        elif delta < -tolerance:
            no_drop = False
            reasons.append(f"{short} drops {delta:+.4f} ({cand:.4f} vs {champ:.4f}), beyond tolerance {tolerance:.4f}")
        elif delta > 0 and delta >= margin:
            improved = True
            reasons.append(
                f"{short} improves {delta:+.4f} ({cand:.4f} vs {champ:.4f}), at least the margin {margin:.4f}"
            )
        else:
            reasons.append(
                f"{short} changes {delta:+.4f} ({cand:.4f} vs {champ:.4f}): within tolerance, "
                f"not an improvement by the margin {margin:.4f}"
            )
    chars_kept, held_by = _chars_saved(candidate, champion, chars_mark, params, numbers, reasons)
    no_drop = no_drop and chars_kept
    evidence = float(candidate[SCORED])
    numbers["evidence/candidate_judge_scored"] = evidence
    numbers["evidence/champion_judge_scored"] = float(champion[SCORED])
    if evidence <= 0:
        reasons.append("no judge evidence: the candidate has no scored suggestion")
    if not improved:
        reasons.append("neither reward per request nor judge mean improves by the margin (equal is not better)")
    passed = no_drop and improved and evidence > 0
    reasons.append("PASS: the candidate may be deployed" if passed else "FAIL: the champion stays")
    return GateDecision(passed, reasons, numbers, held_by)

"""Sticky salted-hash assignment: same user, same arm; shares respected; a new salt reshuffles."""

from __future__ import annotations

from serving.router import assign, champion_of
from tasks.core.store import Arm

ARMS = [Arm("champion", "m/1", "/a", "embedded", 0.7), Arm("challenger", "m/2", "/b", "embedded", 0.3)]


def test_assignment_is_sticky_and_follows_shares():
    users = [f"user-{i}" for i in range(4000)]
    first = {u: assign(u, "ab-v1", ARMS).name for u in users}
    assert first == {u: assign(u, "ab-v1", list(reversed(ARMS))).name for u in users}  # order of arms is irrelevant
    share = sum(name == "challenger" for name in first.values()) / len(users)
    assert abs(share - 0.3) < 0.03
    resalted = {u: assign(u, "ab-v2", ARMS).name for u in users}
    assert sum(first[u] != resalted[u] for u in users) > 500  # a new salt reshuffles users


def test_share_changes_move_only_the_needed_users_and_zero_share_gets_none():
    users = [f"user-{i}" for i in range(2000)]
    before = {u: assign(u, "s", ARMS).name for u in users}
    grown = [Arm("champion", "m/1", "/a", "embedded", 0.5), Arm("challenger", "m/2", "/b", "embedded", 0.5)]
    after = {u: assign(u, "s", grown).name for u in users}
    # Slices are contiguous in name order (challenger first), so growing the challenger only moves champion users.
    assert all(after[u] == "challenger" for u in users if before[u] == "challenger")
    off = [Arm("champion", "m/1", "/a", "embedded", 1.0), Arm("challenger", "m/2", "/b", "embedded", 0.0)]
    assert {assign(u, "s", off).name for u in users} == {"champion"}
    assert champion_of(ARMS).name == "champion"
    assert champion_of([Arm("a", "1", "/a", "embedded", 0.2), Arm("b", "2", "/b", "embedded", 0.8)]).name == "b"

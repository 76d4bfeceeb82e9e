"""One online cycle at a time, and one change of the arms at a time: Prefect global concurrency limits by scope.

- `cycle_slot`: an online cycle holds `tabrl-cycle-<team>-<store>` from its first look at the registry to its end. A
  cycle that finds the slot held does not wait: it ends at once as `skipped` (the collision strategy: the new run is
  dropped, as Prefect's CANCEL_NEW drops it; the next tick of the schedule tries again). Queued, it would train
  minutes later on only the rows the running cycle left.
- `arms_slot`: the cycle's rollout and the A/B decision hold `tabrl-arms-<team>-<store>` while they read and change the
  arms; whichever comes second waits for the first (a decision then reads the arms the rollout left).

The scope is the team's name (`org`: the organisation's; tasks/core/teams.py) and the log store's id
(`tasks.core.store.store_id`): each team its own two slots, so cycles of different teams run side by side, and two
stores never share one (two demos on one machine share Prefect's ephemeral database, not a log store). The limits
are global concurrency limits (limit 1) on the Prefect server the flows report to (the ephemeral one of `tabrl
cycle` too), created on first use; unlike a deployment's concurrency_limit they hold for runs started by hand and
can be keyed per team. A slot is a lease the holder renews: one whose process died is free again after `LEASE_S`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress

from tasks.core.store import open_store, store_id
from tasks.core.teams import ORG

LEASE_S = 300.0  # a dead holder's slot is free again after this long (Prefect's default lease)
ARMS_WAIT_S = 30 * 60.0  # longest an arms change waits for another (a vLLM rollout takes minutes)
SLOW_SERVER_S = 120.0  # how long a free slot is asked for again when the server was too slow to grant it


class SlotTaken(RuntimeError):
    """Another run holds the slot."""


class CycleRunning(SlotTaken):
    """Another online cycle of the scope holds its cycle slot."""


def cycle_slot_name(database_url: str, team: str = ORG) -> str:
    return f"tabrl-cycle-{team}-{_store(database_url)}"


def arms_slot_name(database_url: str, team: str = ORG) -> str:
    return f"tabrl-arms-{team}-{_store(database_url)}"


def _store(database_url: str) -> str:
    with open_store(database_url) as engine:
        return store_id(engine)[:8]


@contextmanager
def cycle_slot(database_url: str, team: str = ORG) -> Iterator[None]:
    """Hold the team's cycle slot of the store, or raise CycleRunning at once when another cycle holds it."""
    with _slot(cycle_slot_name(database_url, team), wait_s=1.0, taken=CycleRunning):
        yield


@contextmanager
def arms_slot(database_url: str, team: str = ORG) -> Iterator[None]:
    """Hold the team's arms slot of the store, waiting up to ARMS_WAIT_S for another change of the arms to finish."""
    with _slot(arms_slot_name(database_url, team), wait_s=ARMS_WAIT_S, taken=SlotTaken):
        yield


@contextmanager
def _slot(name: str, wait_s: float, taken: type[SlotTaken]) -> Iterator[None]:
    from prefect.client.orchestration import get_client
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectAlreadyExists

    # The first user creates the limit. The upsert reads, then creates: a run started at the same moment may have
    # created it in between (409), which is as good.
    with get_client(sync_client=True) as client, suppress(ObjectAlreadyExists):
        client.upsert_global_concurrency_limit_by_name(name, 1)
    deadline = time.monotonic() + max(wait_s, SLOW_SERVER_S)
    with ExitStack() as held:
        while True:
            try:
                held.enter_context(
                    concurrency(
                        name,
                        timeout_seconds=wait_s,
                        lease_duration=LEASE_S,
                        strict=True,
                        raise_on_lease_renewal_failure=False,
                    )
                )
                break
            except TimeoutError as err:
                # A busy server can take longer than wait_s to grant a free slot (the soak saw a cycle skipped as
                # 'held' while nothing held it, on 2 loaded cores): only a slot someone holds is a refusal.
                if _held(name) or time.monotonic() > deadline:
                    raise taken(f"{name} is held by another run (waited {wait_s:.0f} s)") from err
        yield


def _held(name: str) -> bool:
    """Whether a run holds the named limit's slot now, as the server counts its active slots."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(name).active_slots > 0

"""Gateway replicas on one log store and one Redis: the rate limits hold in total (not per replica), and arm
changes and opt-outs reach every replica within serving.config_ttl_s; `tabrl serve --workers 2`.

Real components: gateway processes on loopback (`python -m tests.support.harness gateway`, and `tabrl serve`), SQLite
or PostgreSQL (store_url), Redis at TABRL_TEST_REDIS_URL (default redis://127.0.0.1:6379/0; skipped when it
does not answer)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager

import httpx
import pytest
import redis
import sqlalchemy as sa

from serving.auth import Caller, add_key, set_opt_out
from serving.errors import ApiError
from serving.limits import RedisRateLimiter
from tasks.core.procs import free_port, wait_until_up
from tasks.core.store import CHALLENGER, CHAMPION, Arm, Store, completions, replace_arms
from tests.support.harness import ROOT, editor_prompt, make_keys, seed_arms, start_process, stop_process

REDIS_URL = os.environ.get("TABRL_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
FAST = Arm(CHAMPION, "fast/1", "fast", "embedded", 1.0)


@pytest.fixture
def redis_url() -> str:
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.exceptions.RedisError as err:
        pytest.skip(f"Redis at {REDIS_URL} does not answer ({err}); set TABRL_TEST_REDIS_URL to run the replica tests")
    finally:
        client.close()
    return REDIS_URL


def _sets(*overrides: str) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


@contextmanager
def replicas(store_url: str, n: int, *overrides: str):
    """n gateway processes on store_url (each its own port); yields their base URLs."""
    procs, urls = [], []
    try:
        for _ in range(n):
            port = free_port()
            procs.append(start_process("gateway", port, "--db", store_url, *_sets(*overrides), timeout_s=120))
            urls.append(f"http://127.0.0.1:{port}")
        yield urls
    finally:
        for proc in procs:
            stop_process(proc)


def _complete(url: str, key: str, i: int = 0) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"prompt": editor_prompt(i)},
        timeout=30,
    )


def _count(store_url: str) -> int:
    engine = Store(store_url).engine
    try:
        with engine.connect() as conn:
            return conn.execute(sa.select(sa.func.count()).select_from(completions)).scalar_one()
    finally:
        engine.dispose()


def _eventually(check, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def test_redis_windows_count_both_limits_and_refuse_without_counting(redis_url):
    user, key = f"u-{uuid.uuid4().hex}", uuid.uuid4().hex

    async def main():
        limiter = RedisRateLimiter(redis_url, per_user=3, per_key=2, timeout_s=2)
        try:
            await limiter.acquire(Caller(user, True, True, key_hash=key))
            await limiter.acquire(Caller(user, True, True, key_hash=key))
            with pytest.raises(ApiError) as err:  # the key's window is full; the user's is not
                await limiter.acquire(Caller(user, True, True, key_hash=key))
            assert err.value.status == 429 and "per API key" in err.value.message
            assert 1 <= int(err.value.headers["Retry-After"]) <= 61
            await limiter.acquire(Caller(user, True, False))  # the refused request counted nowhere: user 3 of 3
            with pytest.raises(ApiError, match="per user"):
                await limiter.acquire(Caller(user, True, False))
            # Concurrent requests go to Redis together; still exactly the limit passes.
            many = RedisRateLimiter(redis_url, per_user=100, per_key=6, timeout_s=2)
            other = Caller(f"u-{uuid.uuid4().hex}", True, True, key_hash=uuid.uuid4().hex)
            results = await asyncio.gather(*[many.acquire(other) for _ in range(20)], return_exceptions=True)
            await many.aclose()
            assert results.count(None) == 6 and all(getattr(r, "status", 0) == 429 for r in results if r is not None)
        finally:
            await limiter.aclose()
        down = RedisRateLimiter("redis://127.0.0.1:1/0", per_user=3, per_key=2, timeout_s=1)
        try:
            with pytest.raises(ApiError) as err:
                await down.acquire(Caller(user, True, False))
            assert err.value.status == 503 and "serving.redis_url" in err.value.message
            assert err.value.headers == {"Retry-After": "2"}
        finally:
            await down.aclose()

    asyncio.run(main())


def test_two_replicas_share_the_limits_the_arms_and_the_opt_outs(store_url, redis_url):
    seed_arms(store_url, [FAST])
    (_, key), (bob, bob_key) = make_keys(store_url, 2, prefix=f"r-{uuid.uuid4().hex[:8]}")
    limits = ["serving.rate_limit_per_key_per_minute=6", "serving.rate_limit_per_minute=1000"]
    with replicas(store_url, 2, f"serving.redis_url={redis_url}", "serving.config_ttl_s=0.5", *limits) as (a, b):
        answers = [_complete(a if i % 2 == 0 else b, key, i) for i in range(10)]
        assert [r.status_code for r in answers] == [200] * 6 + [429] * 4  # 6 per minute in total, 3 on each
        assert all("per API key" in r.json()["error"]["message"] and r.headers["Retry-After"] for r in answers[6:])
        assert _count(store_url) == 6

        # An opt-out and an arm change reach both replicas within config_ttl_s, without a restart.
        assert [_complete(url, bob_key).json()["tabrl"]["logged"] for url in (a, b)] == [True, True]
        engine = Store(store_url).engine
        set_opt_out(engine, bob, True)
        replace_arms(engine, [Arm(CHALLENGER, "fast/2", "fast", "embedded", 1.0)])

        def switched():
            fresh = add_key(engine, bob)  # a new key each time: bob's keys stay under the per-key limit
            answers = [_complete(url, fresh) for url in (a, b)]
            assert [r.status_code for r in answers] == [200, 200], answers[0].text
            return all(not r.json()["tabrl"]["logged"] and r.json()["tabrl"]["arm"] == CHALLENGER for r in answers)

        assert _eventually(switched, 10)
        before = _count(store_url)
        assert switched() and _count(store_url) == before  # opted out: served by both, logged by neither
        engine.dispose()


def test_without_redis_each_replica_counts_alone(tmp_path):
    """The control: per-process limits let two replicas serve twice the limit (why replicas need Redis)."""
    store_url = f"sqlite:///{tmp_path}/store.db"
    seed_arms(store_url, [FAST])
    (_, key), *_ = make_keys(store_url, 1)
    with replicas(store_url, 2, "serving.rate_limit_per_key_per_minute=6") as (a, b):
        answers = [_complete(a if i % 2 == 0 else b, key, i) for i in range(12)]
    assert [r.status_code for r in answers] == [200] * 12


def _workers(pid: int) -> int:
    """Child processes of pid spawned by multiprocessing (uvicorn's workers; not its resource tracker)."""
    found = subprocess.run(["pgrep", "-P", str(pid), "-f", "spawn_main"], capture_output=True, text=True)
    return len(found.stdout.split())


def _samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """One metric's samples on a /metrics page, by their sorted labels (the process's pid label aside)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def test_tabrl_serve_workers_share_one_port_and_the_limits(store_url, redis_url, tiny_model_dir, tmp_path):
    port = free_port()
    sets = _sets(
        f"paths.database_url={store_url}",
        "serving.max_tokens=4",
        "serving.rate_limit_per_minute=5",
        f"paths.state_dir={tmp_path / 'state'}",  # the processes' metrics files go under it
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    refused = subprocess.run(
        [sys.executable, "-m", "flows.cli", "serve", "--workers", "2", "--no-auth", *sets],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and "serving.redis_url" in refused.stdout + refused.stderr
    log = open(tmp_path / "serve.log", "w")
    cmd = ["serve", "--workers", "2", "--no-auth", "--model", str(tiny_model_dir), "--port", str(port)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", *cmd, *sets, *_sets(f"serving.redis_url={redis_url}")],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until_up(f"http://127.0.0.1:{port}/healthz", proc, 120)
        assert _eventually(lambda: _workers(proc.pid) == 2, 30), (tmp_path / "serve.log").read_text()[-2000:]
        # A kept-alive connection stays with the worker that accepted it: find one connection per worker.
        by_pid: dict[int, httpx.Client] = {}
        opened = []
        for _ in range(40):
            client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
            opened.append(client)
            by_pid.setdefault(client.get("/healthz").json()["pid"], client)
            if len(by_pid) == 2:
                break
        assert len(by_pid) == 2, "every connection went to one worker"
        user = f"w-{uuid.uuid4().hex[:8]}"
        conns = list(by_pid.values())
        statuses = [
            conns[i % 2].post("/v1/completions", json={"prompt": editor_prompt(i), "user": user}).status_code
            for i in range(8)
        ]
        assert statuses == [200] * 5 + [429] * 3, (tmp_path / "serve.log").read_text()[-2000:]  # 5 in total
        # /metrics sums both processes, whichever answers the scrape (prometheus_client's multiprocess mode)
        for conn in conns:
            scraped = conn.get("/metrics")
            assert scraped.status_code == 200, scraped.text
            completions = _samples(scraped.text, "tabrl_completions_total")
            assert sum(completions.values()) == 5, completions
            requests = _samples(scraped.text, "tabrl_requests_total")
            assert requests[(("endpoint", "/v1/completions"), ("status", "429"))] == 3, requests
            assert not _samples(scraped.text, "tabrl_online_accept_rate"), "a per-process gauge cannot be summed"
        for client in opened:
            client.close()
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
    assert _count(store_url) == 5

"""Fuzzing the gateway from its OpenAPI schema (schemathesis): every endpoint, with and without
auth, valid and invalid inputs. Zero 5xx; stored rows consistent afterwards (exact counts, the
seeded rows untouched, every row well formed)."""

import json

import httpx
import pytest
import schemathesis
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from serving.auth import add_key
from serving.gateway import create_app
from tasks.core.store import Arm, Store, completions, feedback, init_schema, replace_arms
from tests.conftest import tiny_params
from tests.serving_util import serve_app
from tests.support.harness import editor_prompt, fast_backend_factory, row_problems

FEEDBACK_PATHS = ("/v1/feedback", "/api/training/submit", "/api/continue/events")
EXAMPLES = 20  # per operation and mode: 7 operations x 2 modes x 2 auth settings, about 30 s in all


def _body(response) -> dict:
    kind = {k.lower(): v for k, v in response.headers.items()}.get("content-type", "")
    kind = ",".join(kind) if isinstance(kind, list) else kind  # schemathesis' Response: header -> list of values
    if "json" in kind:
        return response.json()
    if "event-stream" in kind:  # stream=true: the first event carries the id and the tabrl block
        first = response.text.split("\n\n")[0]
        return json.loads(first.removeprefix("data: "))
    return {}


def _snapshot(engine):
    with engine.connect() as conn:
        return (
            conn.execute(sa.select(completions).order_by(completions.c.seq)).mappings().all(),
            conn.execute(sa.select(feedback).order_by(feedback.c.seq)).mappings().all(),
        )


@pytest.mark.parametrize("auth", [True, False], ids=["auth", "no-auth"])
def test_fuzzed_requests_never_5xx_nor_corrupt_the_store(tmp_path, auth):
    params = tiny_params(
        tmp_path,
        serving={
            "rate_limit_per_minute": 10**6,
            "rate_limit_per_key_per_minute": 10**6,
            "max_prompt_chars": 2000,
            "max_text_chars": 2000,
            "config_ttl_s": 0,
        },
    )
    engine = Store(params.paths.database_url).engine
    init_schema(engine)
    replace_arms(engine, [Arm("champion", "fast/1", "fast", "embedded", 1.0)])
    key = add_key(engine, "fuzzer")
    headers = {"Authorization": f"Bearer {key}"} if auth else {}
    app = create_app(params, engine=engine, auth=auth, backend_factory=fast_backend_factory)
    answers: list[tuple[str, int, dict]] = []
    with serve_app(app) as url:
        seeded = []
        for i in range(3):  # rows the fuzzer must not disturb
            r = httpx.post(
                f"{url}/v1/completions", headers=headers, json={"prompt": editor_prompt(i), "user": "fuzzer"}
            )
            assert r.status_code == 200, r.text
            seeded.append(r.json()["id"])
        assert (
            httpx.post(
                f"{url}/v1/feedback", headers=headers, json={"completion_id": seeded[0], "accepted": True}
            ).status_code
            == 200
        )
        before = _snapshot(engine)
        schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=schema.as_strategy(mode))
            @settings(
                max_examples=EXAMPLES * 7,
                deadline=None,
                derandomize=True,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            def fuzz(case):
                response = case.call(base_url=url, headers=headers, timeout=20)
                assert response.status_code < 500, (
                    f"{case.method} {case.path} -> {response.status_code}: {response.text[:300]}\n"
                    f"{case.as_curl_command()}"
                )
                body = _body(response)
                answers.append((case.path, response.status_code, body))

            fuzz()
    after = _snapshot(engine)
    paths = {path for path, _, _ in answers}
    assert paths >= {"/v1/completions", "/v1/models", "/healthz", "/metrics", *FEEDBACK_PATHS}, paths
    assert any(status == 200 for path, status, _ in answers if path == "/v1/completions")
    assert any(400 <= status < 500 for _, status, _ in answers)
    # Exactly the acknowledged rows were added, and the seeded rows are unchanged.
    served = [
        b["id"] for p, s, b in answers if p == "/v1/completions" and s == 200 and b.get("tabrl", {}).get("logged")
    ]
    new_feedback = [
        b for p, s, b in answers if p in FEEDBACK_PATHS and s == 200 and b.get("logged") and not b.get("duplicate")
    ]
    assert len(after[0]) == len(before[0]) + len(served)
    assert {r["id"] for r in after[0]} == {r["id"] for r in before[0]} | set(served)
    assert len(after[1]) == len(before[1]) + len(new_feedback)
    assert after[0][: len(before[0])] == before[0] and after[1][: len(before[1])] == before[1]
    assert row_problems(after[0], {"champion"}) == []
    engine.dispose()

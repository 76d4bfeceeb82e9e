"""POST /v1/completions: who is calling, the request normalised, the rate limit, the arm chosen (sticky per
user, the champion when an arm fails), the suggestion committed to the log, then the answer."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping

from serving.errors import ApiError
from serving.log import insert_completion, prompt_hash
from serving.normalise import normalise_request
from serving.protocol import Answer, CompletionRequest, sse_events
from serving.router import UnknownArmError
from serving.state import Gateway


async def completions(gw: Gateway, headers: Mapping[str, str], body: bytes) -> Answer:
    started = time.perf_counter()
    req = CompletionRequest.model_validate_json(body)
    caller = await gw.caller_of(headers, req.user)
    explore = gw.s.explore_fraction > 0 and gw.explore_draws.random() < gw.s.explore_fraction
    inputs = normalise_request(req, gw.s, explore)
    await gw.limiter.acquire(caller)
    forced = headers.get("x-tabrl-arm")
    try:
        arm, champion = await gw.router.route(caller.user_id, forced)
    except UnknownArmError as err:
        raise ApiError(404 if forced else 503, str(err), "X-Tabrl-Arm") from None
    arm, prompt, gen = await gw.router.complete(arm, champion, inputs.request, gw.fell_back)
    completion_id = f"cmpl-{uuid.uuid4().hex}"
    latency_ms = (time.perf_counter() - started) * 1000.0
    if caller.logged:
        await gw.writer.submit(
            insert_completion(
                {
                    "id": completion_id,
                    "created_at": time.time(),
                    "user_id": caller.user_id,
                    "arm": arm.name,
                    "model_version": arm.model_version,
                    "prompt": prompt,  # as the arm's model saw it: training replays the same tokens
                    "prefix": inputs.request.fim.prefix,
                    "suffix": inputs.request.fim.suffix,
                    "completion": gen.text,
                    "token_ids": gen.token_ids,
                    "logprobs": gen.logprobs,
                    "temperature": inputs.request.temperature,
                    "latency_ms": latency_ms,
                    "abstained": not gen.text,
                    "prompt_hash": prompt_hash(inputs.client_prompt, gen.text),
                }
            )
        )
    else:
        gw.metrics.unlogged.inc()
    gw.metrics.served(arm.name, bool(gen.text), time.perf_counter() - started)
    if explore:
        gw.metrics.explored.labels(arm.name).inc()
    created = int(time.time())
    tabrl = {"arm": arm.name, "model_version": arm.model_version, "logged": caller.logged}
    answer_headers = {"X-Tabrl-Arm": arm.name}
    if req.stream:
        return Answer(200, {}, answer_headers, sse_events(completion_id, created, arm, gen, tabrl))
    return Answer(
        200,
        {
            "id": completion_id,
            "object": "text_completion",
            "created": created,
            "model": arm.model_version,
            "choices": [{"text": gen.text, "index": 0, "logprobs": None, "finish_reason": gen.finish_reason}],
            "usage": {"completion_tokens": len(gen.token_ids)},
            "tabrl": tabrl,
        },
        answer_headers,
    )

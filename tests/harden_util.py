"""The hardening tests' own child process: a real tiny model behind an OpenAI-compatible server.

    python -m tests.harden_util backend --model DIR --port P

``backend`` generates with the real tiny model (``tasks.core.generate``) in its own process (so it can be
killed), answering with token ids and log-probs the way vLLM does with ``return_token_ids`` and
``logprobs: 0``. Everything the benchmarks share with the tests is in ``tests/support/harness.py``.
"""

from __future__ import annotations

import argparse
import subprocess
import uuid

from fastapi import FastAPI, Request

from tests.support.harness import start_process


def _serve_backend(model_dir: str, port: int) -> None:
    import uvicorn

    from tasks.core.engines.base import Sampling
    from tasks.core.engines.embedded import EmbeddedBackend

    backend = EmbeddedBackend(model_dir)
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "tiny", "object": "model", "root": model_dir}]}  # as vLLM answers

    @app.get("/health")
    async def health():
        return {}

    @app.post("/v1/completions")
    async def complete(request: Request):
        body = await request.json()
        sampling = Sampling(
            body.get("max_tokens", 8),
            body.get("temperature", 0.7),
            body.get("top_p", 1.0),
            tuple(body.get("stop") or []),
        )
        gen = await backend.complete(body["prompt"], sampling)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "model": "tiny",
            "choices": [
                {
                    "index": 0,
                    "text": gen.raw_text,
                    "finish_reason": gen.finish_reason,
                    "token_ids": gen.token_ids,
                    "logprobs": {"token_logprobs": gen.logprobs},
                }
            ],
        }

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def start_backend(port: int, model_dir: str) -> subprocess.Popen:
    """The tiny-model backend in its own process on port, once it answers."""
    return start_process("backend", port, "--model", model_dir, module="tests.harden_util")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["backend"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    _serve_backend(args.model, args.port)


if __name__ == "__main__":
    main()

"""vLLM servers for arms and evaluations: start one, find the one of a base, and manage its LoRA adapters.

vLLM runs in its own environment (its pins conflict with prefect's), so a server is a process,
`{serving.vllm_python} -m vllm.entrypoints.openai.api_server --model DIR ...`, reached over HTTP on
loopback. Each one this host starts is recorded under `{paths.state_dir}/vllm/<port>.json` (pid, URL,
model, whether LoRA is on) so a later cycle, in another process, finds or stops it.

Two ways a version is served:

* a LoRA adapter: the base's **one** server runs with `--enable-lora` (`--max-loras`,
  `--max-lora-rank` from params) and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`; a version goes live by
  `load_adapter` under a name never used before (vLLM keys its prefix cache by name: a reused name
  can serve stale KV, vllm#42125), is asked once (`probe`), and is dropped by `unload_adapter`.
  `base_server` finds the base's server (or `serving.vllm_url`, one someone else runs) or starts it.
* a full checkpoint: a server of its own (`start_vllm`), blue/green: the new one is healthy before
  traffic moves, the old one is stopped after.

The runtime LoRA endpoints change what a server serves: bind vLLM to loopback or a private network
only (SECURITY.md).
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from tasks.core.adapters import AdapterBaseError, checkpoint_sha256
from tasks.core.config import Params, ServingParams
from tasks.core.dtypes import resolve_dtype
from tasks.core.fim import parse_completion
from tasks.core.generate import Generation, ShowRule, cut_unsure
from tasks.core.greedy_rule import rule_logprobs
from tasks.core.procs import NotUp, free_port, wait_until_up

LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
VLLM_MAX_STOP = 4  # vLLM takes at most 4 stop strings (OpenAI's limit); the full list is applied to the text
ADMIN_TIMEOUT_S = 60.0  # loading an adapter reads its files and builds its weights on the server


class VllmError(RuntimeError):
    """A vLLM server that did not start, or refused or failed a request; the message carries vLLM's own words."""


@dataclass(frozen=True)
class VllmServer:
    pid: int | None  # None: a server someone else runs (serving.vllm_url)
    port: int | None
    url: str  # server root, e.g. http://127.0.0.1:8123 (a vLLM arm's model_uri)
    model_dir: str  # the checkpoint it serves (the base, for a LoRA server)
    lora: bool = False  # started with --enable-lora: adapters load at runtime


def _registry_dir(params: Params) -> Path:
    return Path(params.paths.state_dir) / "vllm"


def server_command(model_dir: str | Path, port: int, params: Params, lora: bool) -> list[str]:
    s = params.serving
    cmd = [s.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", str(model_dir)]
    if lora:
        cmd += ["--enable-lora", "--max-loras", str(s.vllm_max_loras), "--max-lora-rank", str(s.vllm_max_lora_rank)]
        cmd += ["--max-cpu-loras", str(max_cpu_loras(params))]
    dtype = server_dtype(s)
    if dtype is not None:
        cmd += ["--dtype", dtype]
    return cmd + list(s.vllm_args)


def max_cpu_loras(params: Params) -> int:
    """Adapters a LoRA server keeps loaded (--max-cpu-loras): every live one, a champion and a challenger per team
    with a code base and for the organisation, and two for a cycle's gate, at least serving.vllm_max_loras. Past
    it, vLLM evicts the least recently used and loads an adapter again from disk on its next request."""
    return max(params.serving.vllm_max_loras, 2 * (len(params.teams.sources) + 1) + 2)


def server_dtype(serving: ServingParams) -> str | None:
    """The --dtype of the servers tabrl starts: serving.vllm_dtype resolved on this machine (`host`); None: vLLM's
    own choice."""
    return resolve_dtype(serving.vllm_dtype) if serving.vllm_dtype is not None else None


def server_env(params: Params, lora: bool) -> dict[str, str]:
    """A server's environment: serving.vllm_env under this process's (a variable set here wins), with runtime
    LoRA loading when lora."""
    return {**params.serving.vllm_env, **os.environ, **(LORA_ENV if lora else {})}


def start_vllm(model_dir: str | Path, params: Params, lora: bool = False, port: int | None = None) -> VllmServer:
    """Start a vLLM OpenAI server for model_dir (with runtime LoRA when lora) on port (default: a free one) and
    return once /health answers. The model is named by its absolute path (what arms ask for)."""
    model_dir = Path(model_dir).resolve()
    port = port or free_port()
    log_dir = _registry_dir(params)
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / f"{port}.log", "wb") as log:
        proc = subprocess.Popen(
            server_command(model_dir, port, params, lora),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=server_env(params, lora),
        )
    server = VllmServer(proc.pid, port, f"http://127.0.0.1:{port}", str(model_dir), lora)
    (log_dir / f"{port}.json").write_text(json.dumps(asdict(server)))
    try:
        wait_until_up(f"{server.url}/health", proc, params.serving.vllm_start_timeout_s, interval_s=1.0)
        _warm_up(server, params.serving.vllm_start_timeout_s)
    except NotUp as err:
        stop_vllm(proc.pid)
        (log_dir / f"{port}.json").unlink(missing_ok=True)
        raise VllmError(f"vLLM for {model_dir}: {err}; see {log_dir / f'{port}.log'}") from err
    return server


def _warm_up(server: VllmServer, timeout_s: float) -> None:
    """One short completion before the server is handed out: its first requests compile kernels (the CPU build
    runs g++ for torch inductor), time no evaluation's clock or arm's latency should count."""
    body = {"model": server.model_dir, "prompt": "def", "max_tokens": 4}
    try:
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=timeout_s).raise_for_status()
    except httpx.HTTPError as err:
        raise NotUp(f"its first completion failed: {err}") from err


def _records(params: Params) -> list[tuple[Path, VllmServer]]:
    return [(r, VllmServer(**json.loads(r.read_text()))) for r in sorted(_registry_dir(params).glob("*.json"))]


def recorded_servers(params: Params) -> list[VllmServer]:
    """The servers this host started (and recorded) whose process is still alive."""
    found = []
    for record, server in _records(params):
        if server.pid is not None and _alive(server.pid):
            found.append(server)
        else:
            record.unlink(missing_ok=True)  # a server that died: nothing to find or stop there
    return found


def restart_recorded(params: Params) -> list[VllmServer]:
    """Start again, each on its recorded port, the recorded servers whose process is gone (a machine that
    rebooted, a loop resumed from a checkpoint): the arms name their URLs. Their runtime adapters come back
    with `tasks.deploy.arms.sync_adapters` (or the gateway's first request to each)."""
    started = []
    for record, server in _records(params):
        if server.pid is not None and not _alive(server.pid) and server.port is not None:
            record.unlink()
            started.append(start_vllm(server.model_dir, params, server.lora, server.port))
    return started


def base_server(base_dir: str | Path, params: Params) -> VllmServer:
    """The base's one LoRA server: serving.vllm_url when someone else runs it, else the live one this host
    recorded for base_dir, else a new one (health-checked before it is returned)."""
    if params.serving.vllm_url:
        return VllmServer(None, None, params.serving.vllm_url.rstrip("/"), str(base_dir), True)
    for server in recorded_servers(params):
        if server.lora and same_checkpoint(server.model_dir, base_dir) and healthy(server.url):
            return server
    return start_vllm(base_dir, params, lora=True)


def same_checkpoint(a: str | Path, b: str | Path) -> bool:
    """The same directory, or two copies of the same weights (the registry's copy of a base and the original)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return checkpoint_sha256(a) == checkpoint_sha256(b)
    except (AdapterBaseError, OSError):
        return False


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


def stop_vllm(pid: int, grace_s: float = 20.0) -> None:
    """SIGTERM the server's process group, SIGKILL after grace_s."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return


def _alive(pid: int) -> bool:
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:  # our own child: reap it
            return False
    except ChildProcessError:
        pass  # started by another process: only signal 0 can tell
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_vllm_at(url: str, params: Params) -> bool:
    """Stop the recorded server serving url; False when none is recorded (e.g. an external server)."""
    for record in _registry_dir(params).glob("*.json"):
        server = VllmServer(**json.loads(record.read_text()))
        if server.url == url:
            if server.pid is not None:
                stop_vllm(server.pid)
            record.unlink(missing_ok=True)
            return True
    return False


# --- runtime LoRA adapters ------------------------------------------------------------------------


def adapter_name(version_label: str) -> str:
    """A load name never used before for a version (`tabrl-completion/5` -> `tabrl-completion-v5-1f2e3d4c`)."""
    model, _, number = version_label.rpartition("/")
    return f"{model or 'adapter'}-v{number or version_label}-{secrets.token_hex(4)}"


def _post(url: str, path: str, body: dict, timeout_s: float) -> httpx.Response:
    try:
        return httpx.post(f"{url}{path}", json=body, timeout=timeout_s)
    except httpx.HTTPError as err:
        raise VllmError(f"vLLM at {url} unreachable for {path}: {type(err).__name__}: {err}") from err


def _vllm_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    error = body.get("error", body) if isinstance(body, dict) else body
    return str(error.get("message", error) if isinstance(error, dict) else error)[:500]


def load_adapter(url: str, name: str, path: str | Path, timeout_s: float = ADMIN_TIMEOUT_S) -> float:
    """Load the adapter at path under name into the server at url; seconds it took. VllmError with vLLM's own
    message when it refuses (a rank above --max-lora-rank, weights that do not fit its base, a name in use)."""
    started = time.perf_counter()
    response = _post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, timeout_s)
    if response.status_code != 200:
        raise VllmError(
            f"vLLM at {url} refused adapter {path} as {name!r} ({response.status_code}): {_vllm_message(response)}"
        )
    return time.perf_counter() - started


def unload_adapter(url: str, name: str, timeout_s: float = ADMIN_TIMEOUT_S) -> bool:
    """Drop an adapter from the server; False when the server did not hold it (already gone, or restarted)."""
    response = _post(url, "/v1/unload_lora_adapter", {"lora_name": name}, timeout_s)
    if response.status_code == 404:
        return False
    if response.status_code != 200:
        raise VllmError(f"vLLM at {url} could not unload {name!r} ({response.status_code}): {_vllm_message(response)}")
    return True


def probe(url: str, name: str, timeout_s: float = ADMIN_TIMEOUT_S) -> None:
    """One real completion from `name` at url (VllmError when it does not answer one): a version is asked
    once before any user is routed to it."""
    body = {"model": name, "prompt": "def ", "max_tokens": 1, "temperature": 0.0}
    response = _post(url, "/v1/completions", body, timeout_s)
    if response.status_code != 200 or not response.json().get("choices"):
        raise VllmError(f"vLLM at {url} did not complete a probe as {name!r}: {_vllm_message(response)}")


def served_models(url: str) -> dict[str, dict]:
    """What the server at url serves now: model name -> its /v1/models card (adapters carry a `parent`)."""
    try:
        response = httpx.get(f"{url}/v1/models", timeout=10.0)
    except httpx.HTTPError as err:
        raise VllmError(f"vLLM at {url} unreachable: {type(err).__name__}: {err}") from err
    if response.status_code != 200:
        raise VllmError(f"vLLM at {url}/v1/models answered {response.status_code}: {_vllm_message(response)}")
    return {card["id"]: card for card in response.json().get("data", [])}


@functools.lru_cache(maxsize=16)
def start_of_text(checkpoint: str) -> str:
    """What an empty prompt is sent as: the text of the token `tasks.generate.encode_prompt` puts there (the
    tokenizer's BOS, else its EOS), which vLLM's tokenizer reads back as that one token. vLLM refuses an empty
    prompt, and a prefix-only model at the top of a file has nothing else to continue."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    token = tokenizer.bos_token if tokenizer.bos_token_id is not None else tokenizer.eos_token
    if not token:
        raise VllmError(f"{checkpoint}: its tokenizer has no BOS or EOS token to stand for an empty prompt")
    return str(token)


def base_of(url: str) -> str:
    """The checkpoint directory the server at url was started with (its base model's `root`)."""
    bases = [card for card in served_models(url).values() if not card.get("parent")]
    if len(bases) != 1:
        raise VllmError(f"vLLM at {url} serves {len(bases)} base models; expected one")
    return str(bases[0].get("root") or bases[0]["id"])


# --- completions ------------------------------------------------------------------------------------


def completion_body(
    model: str,
    prompt: str,
    max_tokens: int,
    temperature: float,
    top_p: float,
    stop: Sequence[str],
    seed: int | None,
    top_logprobs: int = 0,
) -> dict:
    """The one /v1/completions request both vLLM paths send (the gateway's arm, the evaluation's engine): the raw
    FIM prompt (never `suffix`: Qwen2.5-Coder), the first VLLM_MAX_STOP stop strings (the full list is applied to
    the text by `generation_from_vllm`), the sampled tokens' ids and log-probs (the behaviour policy's, for PPO).
    top_logprobs: also each position's most likely tokens (a greedy evaluation's show rule, `rule_logprobs`)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "stop": list(stop)[:VLLM_MAX_STOP],
        "logprobs": top_logprobs,  # 0: the sampled token's log-prob only
        "return_token_ids": True,
        "skip_special_tokens": False,
    }
    return body if seed is None else body | {"seed": seed}


def generation_from_vllm(
    body: dict,
    stop: Sequence[str],
    latency_ms: float,
    rule: ShowRule | None = None,
    greedy_top: bool = False,
    vocab_size: int = 0,
) -> Generation:
    """Map one vLLM /v1/completions choice onto a Generation (token ids + behaviour log-probs), cut by rule.
    greedy_top: the request was greedy and asked for the top-k (`completion_body(top_logprobs=...)`), so the
    rule compares `rule_logprobs` at its temperature, not vLLM's log-probs at T = 1 (above T = 1 it needs the
    model's vocab_size).
    A cut's text is the kept tokens' strings (vLLM's `logprobs.tokens`); when they do not spell the start of
    the answer (a character split across tokens), nothing is shown: the model was unsure there anyway."""
    try:
        choice = body["choices"][0]
        token_ids = choice.get("token_ids")
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        tokens = (choice.get("logprobs") or {}).get("tokens")
        raw = choice["text"]
    except (KeyError, IndexError, TypeError) as err:
        raise VllmError(f"vLLM answer lacks {err}: {str(body)[:300]}") from err
    if token_ids is None or logprobs is None or len(token_ids) != len(logprobs):
        raise VllmError("vLLM answer lacks token ids or log-probs (needs a vLLM with return_token_ids)")
    gen = Generation(
        text=parse_completion(raw, tuple(stop)),
        token_ids=[int(t) for t in token_ids],
        logprobs=[float(lp) for lp in logprobs],
        raw_text=raw,
        latency_ms=latency_ms,
        finish_reason="length" if choice.get("finish_reason") == "length" else "stop",
        prompt_tokens=(body.get("usage") or {}).get("prompt_tokens"),
    )
    shown_logprobs = gen.logprobs
    if rule is not None and greedy_top:  # a greedy request that asked for the top-k: the rule at its temperature
        top = (choice.get("logprobs") or {}).get("top_logprobs")
        if not top or len(top) != len(gen.logprobs):
            raise VllmError("vLLM answer lacks the top log-probs a greedy show rule needs (logprobs.top_logprobs)")
        shown_logprobs = rule_logprobs(gen.logprobs, top, rule.temperature, vocab_size)
    unsure = None if rule is None else rule.first_unsure(shown_logprobs, gen.finish_reason == "stop")
    if unsure is None:
        return gen
    if tokens is None or len(tokens) != len(token_ids):
        raise VllmError("vLLM answer lacks the token strings (logprobs.tokens) a cut at an unsure token needs")
    kept = "".join(tokens[:unsure])
    if not raw.startswith(kept):  # a character split across the kept tokens: show nothing
        unsure, kept = 0, ""
    return cut_unsure(gen, unsure, kept, stop)

"""Cleaning: each rule drops what it should and is counted; planted secrets never reach a snapshot."""

import pyarrow.parquet as pq
import pytest

from tasks.core.config import IngestParams
from tasks.ingest.clean import RULES, Cleaner, SecretScanner
from tasks.ingest.snapshot import run_ingest
from tests.conftest import tiny_params
from tests.ingest_helpers import AWS_KEY_LINE, PRIVATE_KEY, add_completions, completion_row, opt_out, store


def test_secret_scanner_finds_planted_keys_and_passes_ordinary_code():
    scanner = SecretScanner(IngestParams().secret_detectors, cache_lines=100)
    code = "import os\n\ndef handler(event):\n    return os.environ['HOME'] + event['path']\n"
    assert scanner.secret_types(code) == []
    assert scanner.secret_types(code) == []  # from the clean-line cache
    assert scanner.secret_types(code + AWS_KEY_LINE + "\n") == ["AWS Access Key"]
    assert scanner.secret_types(PRIVATE_KEY) == ["Private Key"]
    with pytest.raises(ValueError, match="NoSuchDetector"):
        SecretScanner(("NoSuchDetector",), 0)


def test_each_rule_is_counted_in_order():
    cleaner = Cleaner(IngestParams(per_user_cap=2, max_prompt_chars=50, max_completion_chars=40))
    decisions = [
        cleaner.keep("u1", "p1", "c1"),
        cleaner.keep("u1", "p1", "c1"),  # duplicate
        cleaner.keep("u2", "p1", "c1"),  # same texts, another user: kept
        cleaner.keep("u1", "p2", "c1", trainable=False),
        cleaner.keep("u3", "p3", "c1", opted_out=True),
        cleaner.keep("u1", "x" * 51, "c"),  # prompt too long
        cleaner.keep("u1", "p4", "y" * 41),  # completion too long
        cleaner.keep("u1", AWS_KEY_LINE, "c"),
        cleaner.keep("u1", "p5", PRIVATE_KEY.splitlines()[0]),  # in the completion
        cleaner.keep("u1", "p6", "c"),  # u1's second kept row: the cap
        cleaner.keep("u1", "p7", "c"),  # over the cap
    ]
    assert decisions == [True, False, True, False, False, False, False, False, False, True, False]
    assert cleaner.report == {
        "rows_in": 11,
        "not_trainable": 1,
        "opted_out": 1,
        "too_long": 2,
        "duplicate": 1,
        "secret": 2,
        "per_user_cap": 1,
        "rows_out": 3,
    }
    assert set(RULES) <= set(cleaner.report)


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_snapshot_holds_only_clean_rows(tmp_path, backend):
    params = tiny_params(tmp_path, ingest={"per_user_cap": 3, "max_prompt_chars": 400})
    rows = [completion_row(f"cap{i}", 100.0 + i, user="heavy") for i in range(5)]  # 3 kept, 2 capped
    rows += [
        completion_row("dup1", 110.0, user="u2", prompt="same", completion="same"),
        completion_row("dup2", 111.0, user="u2", prompt="same", completion="same"),
        completion_row("aws", 112.0, user="u2", prompt=f"<|fim_prefix|>{AWS_KEY_LINE}\n<|fim_suffix|><|fim_middle|>"),
        completion_row("pem", 113.0, user="u2", completion=PRIVATE_KEY),
        completion_row("gone", 114.0, user="leaver"),
        completion_row("long", 115.0, user="u2", prompt="z" * 401),
    ]
    with store(backend, tmp_path) as engine:
        add_completions(engine, rows)
        opt_out(engine, "leaver")
        result = run_ingest(engine, params, tmp_path, 500.0)
    kept = pq.read_table(result.snapshot)
    assert kept.column("completion_id").to_pylist() == ["cap0", "cap1", "cap2", "dup1"]
    assert result.report == {
        "rows_in": 11,
        "not_trainable": 0,
        "opted_out": 1,
        "too_long": 1,
        "duplicate": 1,
        "secret": 2,
        "per_user_cap": 2,
        "rows_out": 4,
    }
    texts = " ".join(kept.column("prompt").to_pylist() + kept.column("completion").to_pylist())
    assert "AKIA" not in texts and "PRIVATE KEY" not in texts
    assert result.arms["all"].requests == 11  # the cycle's stats still count every decided row


def test_batched_scan_agrees_with_detect_secrets_line_by_line():
    """The joined-text prefilter must never hide a line the plugins flag, wherever the secret sits."""
    scanner = SecretScanner(IngestParams().secret_detectors, cache_lines=1000)
    secrets = [
        "AKIAIOSFODNN7EXAMPLE",
        "ghp_" + "a" * 36,
        "-----BEGIN OPENSSH PRIVATE KEY-----",
        "xoxb-1234-5678-abcdefgh",
        "sk_live_" + "b" * 24,
        "https://user:hunter2@example.com/x",
    ]
    lines = []
    for i, secret in enumerate(secrets):
        lines += [secret, f"key = '{secret}'", f"{secret} # tail", "    return value + 1", f"x{i} = {i}"]
    lines += ["ghp_", "AKIA" + "Z" * 10]  # near misses: no verdict
    expected = {line for line in lines if scanner.line_types(line)}
    assert len(expected) == 3 * len(secrets)
    assert scanner._with_secrets(lines) == expected
    assert scanner.flag(["\n".join(lines[3:5]), "\n".join(lines[:2])]) == [False, True]

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from tasks.core.config import Params, ParamsError, env_overrides, load_params, parse_override
from tasks.core.vllm import server_command, server_env

REPO = Path(__file__).resolve().parents[1]


def test_repo_params_file_loads_with_documented_fields():
    params = load_params(REPO / "params.yaml", environ={})
    assert params.reward.accepted == 0.75 and params.reward.rejected == -0.25 and params.reward.abstained == 0.0
    assert {"data", "model", "fim", "simulator", "reward", "train", "evaluate", "deploy", "serving", "paths"} <= set(
        type(params).model_fields
    )
    for section in type(params).model_fields.values():
        for name, field in section.annotation.model_fields.items():
            assert field.description, f"{section.annotation.__name__}.{name} has no docstring"


def test_the_code_defaults_are_the_shipped_params():
    """One set of defaults (issue 55): the code's are the shipped ones and params.yaml repeats them, for DVC (the
    stages' params must be in the file) and for the reader (the knobs that matter, with their decision records).
    A key whose value in params.yaml drifts from its default in tasks/core/config/ fails here, by name."""
    shipped, defaults = load_params(REPO / "params.yaml", environ={}).flat(), Params().flat()
    drifted = {key: (defaults[key], value) for key, value in shipped.items() if value != defaults[key]}
    assert not drifted, f"params.yaml differs from the code's defaults (key: (code, file)): {drifted}"
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    for name, stage in yaml.safe_load((REPO / "dvc.lock").read_text())["stages"].items():
        for section, values in stage["params"]["params.yaml"].items():  # data, fim, model, traffic: kept whole
            assert raw[section] == values, f"params.yaml's {section} is not what dvc.lock's {name} stage was built on"


def test_the_shipped_overlays_load_together_on_params_yaml():
    """params.real-model.yaml (LoRA versions on SmolLM2) and params.vllm-cpu.yaml (vLLM's CPU build), as the
    results' commands apply them: every key known, and each sets what its comments say."""
    params = load_params(
        REPO / "params.yaml",
        [f"@{REPO / name}" for name in ("params.real-model.yaml", "params.vllm-cpu.yaml")],
        environ={},
    )
    assert params.train.adapter == "lora" and params.model.base_dir == "models/smollm2-135m"
    assert params.serving.backend == "vllm" and params.evaluate.adapter_engine == "merged"
    assert params.serving.adapter_serving == "lora"  # the arms stay adapters on one server
    assert {"--enforce-eager", "processed_logprobs", "--enable-prefix-caching"} <= set(params.serving.vllm_args)
    assert (params.train.compute_dtype, params.serving.vllm_dtype) == ("host", "host")


@pytest.mark.parametrize(
    ("amx", "avx512_bf16", "dtype"),
    [(True, False, "bfloat16"), (False, True, "bfloat16"), (True, True, "bfloat16"), (False, False, "float32")],
)
def test_host_dtype_is_bf16_only_where_the_cpu_has_bf16_matrix_units(monkeypatch, amx, avx512_bf16, dtype):
    """`host` (the overlays' dtype): bfloat16 on a CPU with AMX or AVX512-BF16, float32 on one with neither, where
    bf16 is slow; a server gets the resolved --dtype once, and a second --dtype in vllm_args is refused."""
    import torch

    from tasks.core.dtypes import resolve_dtype

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    assert resolve_dtype("host") == dtype and resolve_dtype("float32") == "float32"
    params = load_params(REPO / "params.yaml", [f"@{REPO / 'params.vllm-cpu.yaml'}"], environ={})
    cmd = server_command("models/m", 8000, params, lora=False)
    assert cmd.count("--dtype") == 1 and cmd[cmd.index("--dtype") + 1] == dtype
    with pytest.raises(ParamsError, match="both set the servers' dtype"):
        load_params(REPO / "params.yaml", [f"@{REPO / 'params.vllm-cpu.yaml'}", "serving.vllm_args=[--dtype,float32]"])


def test_a_vllm_server_gets_the_overlays_environment_under_the_callers(monkeypatch):
    """serving.vllm_env reaches the servers tabrl starts; a variable the caller set wins; LoRA servers also get
    runtime adapter loading."""
    params = load_params(REPO / "params.yaml", [f"@{REPO / 'params.vllm-cpu.yaml'}"], environ={})
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    env = server_env(params, lora=False)
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"  # the scheduler's core goes to the model on a small machine
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"  # the overlay says 1; the caller's 3 wins
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env
    assert server_env(params, lora=True)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in server_env(load_params(REPO / "params.yaml", environ={}), False)


def test_unknown_key_is_rejected_with_its_name(tmp_path):
    file = tmp_path / "params.yaml"
    file.write_text("train:\n  lrr: 0.1\n")
    with pytest.raises(ParamsError, match=r"train\.lrr: unknown key"):
        load_params(file, environ={})


def test_bad_value_names_key_value_and_range(tmp_path):
    file = tmp_path / "params.yaml"
    file.write_text("data:\n  test_fraction: 1.5\n")
    with pytest.raises(ParamsError) as err:
        load_params(file, environ={})
    assert "data.test_fraction = 1.5" in str(err.value) and "less than 1" in str(err.value)


def test_wrong_type_and_literal_are_rejected():
    with pytest.raises(
        ParamsError, match=r"reward.advantage = 'mean'.*'raw', 'batch_mean', 'batch_norm' or 'shown_mean'"
    ):
        load_params(None, ["reward.advantage=mean"], environ={})
    with pytest.raises(ParamsError, match=r"train.epochs = 'two'"):
        load_params(None, ["train.epochs=two"], environ={})


def test_head_dim_rule_explains_the_fix():
    with pytest.raises(ParamsError, match=r"hidden_size / num_heads must be a whole number >= 32, got 64/4"):
        load_params(None, ["model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=1"], environ={})


def test_env_then_cli_override_single_keys():
    env = {"TABRL_TRAIN__LR": "1e-4", "TABRL_DATABASE_URL": "sqlite:///x.db", "HOME": "/root"}
    params = load_params(None, [], environ=env)
    assert params.train.lr == 1e-4 and params.paths.database_url == "sqlite:///x.db"
    params = load_params(None, ["train.lr=3e-4"], environ=env)
    assert params.train.lr == 3e-4
    assert env_overrides({"PATH": "/bin", "TABRL_OTHER": "1"}) == []


def test_override_syntax_errors():
    with pytest.raises(ParamsError, match="section.key=value"):
        parse_override("train.lr")
    assert parse_override("fim.span_weights={line: 1.0}") == ("fim.span_weights", {"line": 1.0})


def test_params_are_frozen():
    params = load_params(None, environ={})
    with pytest.raises(ValidationError):
        params.train.lr = 1.0  # type: ignore[misc]


def test_missing_file_says_how_to_fix(tmp_path):
    with pytest.raises(ParamsError, match="not found"):
        load_params(tmp_path / "nope.yaml", environ={})


def test_cluster_settings_that_cannot_work_are_rejected_with_the_value():
    with pytest.raises(
        ParamsError, match=r"train_on = 'pool' needs an MLflow tracking server.*'sqlite:///state/mlflow.db'"
    ):
        load_params(None, ["cluster.train_on=pool"], environ={})
    ok = load_params(None, ["cluster.train_on=pool", "paths.mlflow_tracking_uri=http://10.0.0.5:5000"], environ={})
    assert ok.cluster.gpu_pool == "gpu" and ok.cluster.cpu_pool == "cpu"
    with pytest.raises(ParamsError, match=r"num_nodes = 2 needs a hostfile"):
        load_params(None, ["train.num_nodes=2"], environ={})


def test_multi_node_deepspeed_launch_takes_the_hostfile_and_node_count():
    from tasks.train.launch import launcher_command

    cmd = launcher_command(8, gpus=True, num_nodes=4, hostfile="/etc/tabrl/hostfile")
    assert cmd[:7] == ["deepspeed", "--hostfile", "/etc/tabrl/hostfile", "--num_nodes", "4", "--num_gpus", "8"]
    assert "--hostfile" not in launcher_command(2, gpus=True)

"""A registered version as an MLflow model: `mlflow.pyfunc.load_model("models:/tabrl-completion@champion")` loads it
and `predict` completes prompts, and the MLflow UI's model page shows how to load it.

The version's artifact is the checkpoint folder itself (a Hugging Face checkpoint, or a LoRA adapter and the
record of its base: `tasks/core/adapters.py`), what every other part of tabrl reads, so the MLflow model is that
folder plus an `MLmodel` file whose `python_function` flavor names this module as its loader (`loader_module`,
MLflow's custom-flavor way) and no `data` subfolder: MLflow hands the loader the folder. Chosen over the
transformers flavor, which saves a PEFT adapter with a hub reference to its base, while tabrl's bases are local
and loaded offline: an adapter version is loaded on the base its record names, the weights checked against the
recorded sha256 (`tasks.core.generate.load_model`). The environment that loads it needs tabrl installed.

`predict(prompts)`: a list of FIM prompts (the model's own template, as the gateway renders them), a string, or a
DataFrame with a `prompt` column (or one column); `params` may set `max_tokens` and `temperature` (greedy by
default); returns the completions as strings, in order.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from tasks.core.generate import LoadedModel, generate, load_model

MLMODEL = "MLmodel"
LOADER = __name__  # MLflow imports this module and calls _load_pyfunc(folder)
DEFAULT_MAX_TOKENS = 32


def mlmodel_file(run_id: str, artifact_path: str, out_dir: Path) -> Path:
    """Write the MLmodel file of a version logged as `artifact_path` of run `run_id` into out_dir; its path."""
    from mlflow.models import Model, ModelSignature
    from mlflow.pyfunc import add_to_model
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    signature = ModelSignature(  # MLflow passes `params` to predict only where the signature declares them
        inputs=Schema([ColSpec("string")]),  # a list of prompts (or a DataFrame of one column, or `prompt`)
        outputs=Schema([ColSpec("string")]),
        params=ParamSchema(
            [ParamSpec("max_tokens", "long", DEFAULT_MAX_TOKENS), ParamSpec("temperature", "double", 0.0)]
        ),
    )
    model = Model(artifact_path=artifact_path, run_id=run_id, signature=signature)
    add_to_model(model, loader_module=LOADER)
    path = out_dir / MLMODEL
    model.save(str(path))
    return path


def log_mlmodel(client, run_id: str, artifact_path: str) -> None:
    """Add the MLmodel file to a checkpoint folder already logged as the run's `artifact_path`."""
    with tempfile.TemporaryDirectory(prefix="tabrl-mlmodel-") as tmp:
        client.log_artifact(run_id, str(mlmodel_file(run_id, artifact_path, Path(tmp))), artifact_path)


class CompletionModel:
    """What `mlflow.pyfunc.load_model` wraps: a loaded checkpoint that completes FIM prompts."""

    def __init__(self, lm: LoadedModel) -> None:
        self.lm = lm

    def predict(self, model_input: Any, params: dict[str, Any] | None = None) -> list[str]:
        prompts = _prompts(model_input)
        options = params or {}
        model, tokenizer, template = self.lm
        gens = generate(
            model,
            tokenizer,
            template,
            prompts,
            int(options.get("max_tokens", DEFAULT_MAX_TOKENS)),
            temperature=float(options.get("temperature", 0.0)),
        )
        return [g.text for g in gens]


def _prompts(model_input: Any) -> list[str]:
    if isinstance(model_input, str):
        return [model_input]
    if hasattr(model_input, "columns"):  # a pandas DataFrame: its `prompt` column, or its only one
        columns = list(model_input.columns)
        if "prompt" not in columns and len(columns) != 1:
            raise ValueError(f"predict needs a `prompt` column (or only one column), got {columns}")
        return [str(p) for p in model_input["prompt" if "prompt" in columns else columns[0]]]
    prompts = list(model_input)
    if not all(isinstance(p, str) for p in prompts):
        raise ValueError("predict takes a prompt, a list of prompts or a DataFrame with a `prompt` column")
    return prompts


def _load_pyfunc(path: str) -> CompletionModel:
    """MLflow's entry point: the version's folder (the checkpoint, or the adapter on its recorded base)."""
    return CompletionModel(load_model(path))

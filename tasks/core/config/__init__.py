"""One typed, frozen config tree loaded from ``params.yaml``.

Every knob of tabrl lives in ``params.yaml`` (DVC tracks it as the params of every stage) and is
described in this package, once, by the docstring under its field. Values are overridden one key at a time:

* CLI: ``tabrl ... --set train.lr=1e-5`` (the value is parsed as YAML: numbers, booleans, lists);
* an overlay file: ``tabrl ... --set @params.real-model.yaml`` (sections of params.yaml's shape, applied
  where it stands among the other ``--set``s);
* environment: ``TABRL_TRAIN__LR=1e-5`` (section and key joined by a double underscore);
  ``TABRL_DATABASE_URL`` is a short alias for ``paths.database_url``.

CLI beats environment beats file. Unknown keys and bad values fail with a message naming the key,
the value and what is allowed.

The tree is split by section into the modules of this package; import every name from here.
"""

from tasks.core.config.base import ParamsError, Section
from tasks.core.config.data import (
    SHIPPED_CORPUS,
    DataParams,
    FimParams,
    ModelParams,
    Persona,
    SimulatorParams,
    TeamsParams,
    TrafficParams,
)
from tasks.core.config.learning import EvaluateParams, JudgeParams, RewardParams, TrainParams
from tasks.core.config.load import (
    DEFAULT_PARAMS_FILE,
    ENV_ALIASES,
    ENV_PREFIX,
    env_overrides,
    load_params,
    overlay_overrides,
    parse_override,
)
from tasks.core.config.operations import (
    BACKENDS,
    BackendName,
    ClusterParams,
    DeployParams,
    IngestParams,
    PathsParams,
    ServingParams,
    check_backend,
)
from tasks.core.config.tree import Params

__all__ = [
    "BACKENDS",
    "BackendName",
    "check_backend",
    "DEFAULT_PARAMS_FILE",
    "ENV_ALIASES",
    "ENV_PREFIX",
    "SHIPPED_CORPUS",
    "ClusterParams",
    "DataParams",
    "DeployParams",
    "EvaluateParams",
    "FimParams",
    "IngestParams",
    "JudgeParams",
    "ModelParams",
    "Params",
    "ParamsError",
    "PathsParams",
    "Persona",
    "RewardParams",
    "Section",
    "ServingParams",
    "SimulatorParams",
    "TeamsParams",
    "TrafficParams",
    "TrainParams",
    "env_overrides",
    "load_params",
    "overlay_overrides",
    "parse_override",
]

"""How many copies of a big checkpoint the registry makes, and what each step costs.

    python -m bench.deploy_registry --mb 512

Builds a fake checkpoint (config.json + one random model.safetensors of --mb MiB) in a temp dir, a
fresh MLflow SQLite store beside it, then times: log + register (the one copy into the artifact
store), resolving `models:/NAME@champion` in place (local store: no copy), and resolving with a
download into the cache (what a remote store needs), cold and warm. Prints a table, writes
bench/out/deploy_registry.json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def _bytes_under(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=512, help="size of the fake model.safetensors in MiB")
    args = ap.parse_args()

    from tasks.core.config import load_params
    from tasks.core.store import CHAMPION
    from tasks.deploy.model_cache import resolve_model_dir
    from tasks.deploy.registry import Registry
    from tasks.deploy.tracking import CycleRuns

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        ckpt = tmp / "ckpt"
        ckpt.mkdir()
        (ckpt / "config.json").write_text("{}")
        with open(ckpt / "model.safetensors", "wb") as f:
            for _ in range(args.mb):
                f.write(os.urandom(1 << 20))
        params = load_params(
            None,
            [f"paths.state_dir={tmp / 'state'}", f"paths.mlflow_tracking_uri=sqlite:///{tmp / 'mlflow.db'}"],
            environ={},
        )
        registry = Registry(params)
        run_id = CycleRuns(params).start()  # first use creates the store (migrations), not timed below
        rows = []

        t = time.perf_counter()
        mv = registry.register(ckpt, run_id)
        registry.set_alias(CHAMPION, mv.version)
        rows.append(("log + register", time.perf_counter() - t, _bytes_under(tmp / "state")))

        t = time.perf_counter()
        local = resolve_model_dir(f"models:/{mv.name}@{CHAMPION}", params)
        rows.append(("resolve in place", time.perf_counter() - t, _bytes_under(tmp / "state")))

        t = time.perf_counter()
        resolve_model_dir(f"models:/{mv.name}@{CHAMPION}", params, copy=True)
        rows.append(("resolve with download (cold)", time.perf_counter() - t, _bytes_under(tmp / "state")))

        t = time.perf_counter()
        resolve_model_dir(f"models:/{mv.name}@{CHAMPION}", params, copy=True)
        rows.append(("resolve with download (warm)", time.perf_counter() - t, _bytes_under(tmp / "state")))

        size = _bytes_under(ckpt)
        print(f"checkpoint: {size / 2**20:.0f} MiB; in-place dir: {local}")
        print(f"{'step':32s} {'seconds':>9s} {'bytes stored / checkpoint':>27s}")
        for name, secs, stored in rows:
            print(f"{name:32s} {secs:9.3f} {stored / size:27.2f}")
    out = Path("bench/out")
    out.mkdir(parents=True, exist_ok=True)
    (out / "deploy_registry.json").write_text(
        json.dumps(
            {"checkpoint_mib": args.mb, "steps": [{"step": n, "seconds": s, "copies": b / size} for n, s, b in rows]},
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()

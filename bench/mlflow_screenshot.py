"""The MLflow UI's runs view of an experiment as a PNG, taken in headless Chromium as a person sees it.

    make screenshot                          # the demo's store (state/demo/mlflow.db) -> docs/img/mlflow-runs.png
    python -m bench.mlflow_screenshot --store sqlite:///state/shot/mlflow.db --out /tmp/runs.png
    python -m bench.mlflow_screenshot --page models/tabrl-completion/versions/2 --wait-for "Source run" \
        --out docs/img/mlflow-version.png           # another page of the UI: a registered version

Starts `mlflow server` on a free loopback port against the store (one worker, no job runner: two
processes), then Chromium from Debian's packages (`apt-get install -y chromium`) headless, and drives
it over the DevTools protocol (`websockets`, which Prefect installs): open the experiment's runs
view, wait for the runs, take the picture.

Two things a plain `chromium --screenshot URL` gets wrong, and what is done instead:

* MLflow 3.17's UI picks GenAI or "Model training" with one global switch (a URL parameter, else
  the browser's last choice, GenAI at first); the experiment's `mlflow.experimentKind` tag, which
  tabrl sets, is read only when that switch is off. The URL asks for `workflowType=machine_learning`,
  as the link tabrl prints does.
* The first visit opens MLflow's assistant panel over a quarter of the page, and the Run Name column
  is narrower than names like `cycle 3 · deployed · tabrl-completion/4 → promoted`. The panel is
  closed as a returning user has it, and the column is dragged wider by its header edge, as a
  person would.
"""

from __future__ import annotations

import argparse
import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from websockets.sync.client import ClientConnection, connect

from tasks.core.procs import free_port, wait_until_up

# MLflow's own localStorage keys (its `useLocalStorage` hook stores JSON under `<key>_v<version>`).
ASSISTANT_CLOSED = {"mlflow.assistant.panelOpen_v1": "false", "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": "true"}
# The overflow of the widest run name, and where the Run Name header's resize edge is.
NAME_COLUMN = """(() => {
  const header = [...document.querySelectorAll('.ag-header-cell')].find(c => c.innerText.trim() === 'Run Name');
  const edge = header && header.querySelector('.ag-header-cell-resize');
  const colId = header && header.getAttribute('col-id');
  const cells = [...document.querySelectorAll(`.ag-cell[col-id="${colId}"]`)];
  const overflow = Math.max(0, ...cells.map(c => [...c.querySelectorAll('*')]
      .reduce((m, e) => Math.max(m, e.scrollWidth - e.clientWidth), c.scrollWidth - c.clientWidth)));
  if (!edge) return null;
  const r = edge.getBoundingClientRect();
  return {x: r.x + 2, y: r.y + r.height / 2, overflow};  // inside the Run Name header, not the next one
})()"""


class DevTools:
    """The smallest DevTools-protocol client: a command, its result (events are skipped)."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws, self.ids = ws, itertools.count(1)

    def __call__(self, method: str, **params: object) -> dict:
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.ws.recv())
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def evaluate(self, expression: str) -> object:
        return self("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.evaluate(expression):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the page did not show {expression!r} within {timeout_s:.0f} s")
            time.sleep(0.5)


def experiment_id(store: str, name: str) -> str:
    from mlflow import MlflowClient

    found = MlflowClient(tracking_uri=store).get_experiment_by_name(name)
    if found is None:
        raise SystemExit(f"no experiment {name!r} in {store}: run `make demo` (or python -m flows.online_loop) first")
    return found.experiment_id


def screenshot(
    store: str, experiment: str, out: Path, width: int, height: int, chromium: str, page: str | None, wait_for: str
) -> str:
    """Take the picture of the experiment's runs view, or of `page` (the part of the UI's URL after `#/`),
    once the text `wait_for` shows; returns the URL (on a server that is gone by then)."""
    if shutil.which(chromium) is None:
        raise SystemExit(f"no {chromium!r} on PATH: apt-get install -y chromium")
    exp = experiment_id(store, experiment)
    port, devtools_port = free_port(), free_port()
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    server_cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", store]
    server_cmd += ["--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    profile = Path(tempfile.mkdtemp(prefix="tabrl-chromium-"))
    # Own process groups: the server's worker and Chromium's helpers stop with them.
    server = subprocess.Popen(
        server_cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    browser = None
    try:
        wait_until_up(f"http://127.0.0.1:{port}/health", server, 120)
        browser = subprocess.Popen(
            [
                chromium,
                "--headless",
                "--no-sandbox",  # Chromium refuses its sandbox as root (CI containers); the page is our own server
                "--disable-gpu",
                "--hide-scrollbars",
                f"--window-size={width},{height}",
                f"--user-data-dir={profile}",
                f"--remote-debugging-port={devtools_port}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        wait_until_up(f"http://127.0.0.1:{devtools_port}/json/version", browser, 60)
        targets = httpx.get(f"http://127.0.0.1:{devtools_port}/json/list").json()
        target = next(t for t in targets if t["type"] == "page")
        url = f"http://127.0.0.1:{port}/#/" + (page or f"experiments/{exp}/runs?workflowType=machine_learning")
        shown = f"document.body.innerText.includes({json.dumps(wait_for)})"
        with connect(target["webSocketDebuggerUrl"], max_size=None) as ws:
            cdp = DevTools(ws)
            cdp("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
            cdp("Page.navigate", url=url)
            cdp.wait_for(shown, 90)
            for key, value in ASSISTANT_CLOSED.items():
                cdp.evaluate(f"localStorage.setItem({json.dumps(key)}, {json.dumps(value)})")
            cdp("Page.reload")
            time.sleep(1.0)
            cdp.wait_for(shown, 90)
            time.sleep(2.0)  # the grid settles (column sizes, run colours)
            column = cdp.evaluate(NAME_COLUMN)
            if isinstance(column, dict) and column["overflow"] > 0:
                x, y, dx = column["x"], column["y"], column["overflow"] + 24
                cdp("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
                cdp("Input.dispatchMouseEvent", type="mousePressed", x=x, y=y, button="left", buttons=1, clickCount=1)
                for step in range(1, 11):
                    cdp(
                        "Input.dispatchMouseEvent",
                        type="mouseMoved",
                        x=x + dx * step / 10,
                        y=y,
                        button="left",
                        buttons=1,
                    )
                cdp("Input.dispatchMouseEvent", type="mouseReleased", x=x + dx, y=y, button="left", clickCount=1)
                time.sleep(1.0)
            png = cdp("Page.captureScreenshot", format="png")["data"]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(base64.b64decode(png))
        return url
    finally:
        for proc in (browser, server):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=30)
        shutil.rmtree(profile, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", default="sqlite:///state/demo/mlflow.db", help="MLflow backend store URI")
    parser.add_argument("--experiment", default="tabrl", help="experiment whose runs to show (deploy.experiment)")
    parser.add_argument("--out", type=Path, default=Path("docs/img/mlflow-runs.png"), help="PNG to write")
    parser.add_argument("--size", default="1600,900", help="browser window WIDTH,HEIGHT in pixels")
    parser.add_argument("--chromium", default="chromium", help="the Chromium binary")
    parser.add_argument("--page", default=None, help="another page: the UI's URL after '#/' (default: the runs)")
    parser.add_argument("--wait-for", default="matching runs", help="text the page shows once it has loaded")
    args = parser.parse_args(argv)
    width, height = (int(v) for v in args.size.split(","))
    url = screenshot(args.store, args.experiment, args.out, width, height, args.chromium, args.page, args.wait_for)
    print(f"{args.out}: {url} ({args.store})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

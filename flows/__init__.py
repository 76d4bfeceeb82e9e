"""The top floor: Prefect flows, the demo driver and the CLI.

Prefect's ephemeral server gets 20 s to start by default, and a busy 2-core laptop can need more. Prefect reads
its settings when it is first imported, so the longer default is set here, before any flow module imports it."""

import os

os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

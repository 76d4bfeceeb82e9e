"""`python -m flows.cli ARGS` == `tabrl ARGS` (for environments where the console script is not on PATH)."""

from flows.cli.main import app

app()

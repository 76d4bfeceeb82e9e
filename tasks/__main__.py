"""`python -m tasks ARGS` == `tabrl ARGS` (for environments where the console script is not on PATH)."""

from tasks.cli import app

app()

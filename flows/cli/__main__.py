"""`python -m flows.cli ARGS` == `tabrl ARGS` (for environments where the console script is not on PATH)."""

from flows.cli.main import app

app(prog_name="tabrl")  # its name in help and in shell completion's variables, as the console script's

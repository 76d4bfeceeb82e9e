"""The top floor's command line, one module per noun; `main.py` is the root app (`tabrl`)."""

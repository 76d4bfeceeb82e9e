"""The shared core of the bottom floor: config, FIM templates, record schema, outcomes and their pricing,
the log store, generation, inference engines, adapters, vLLM servers and process helpers. It imports
nothing above it."""

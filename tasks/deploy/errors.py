"""The deploy stage's error: a state of the registry, the runs or the arms that a person must fix."""

from __future__ import annotations


class DeployError(RuntimeError):
    """The registry or the arms are not in a state that allows the step; the message says why and what to do."""

"""The plan core's error type, in a module of its own so that every core module can raise it."""


class PlanError(ValueError):
    """A placement or plan violates the plan model's invariants."""

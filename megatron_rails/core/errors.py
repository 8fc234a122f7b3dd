"""The package's error types, in a module of its own so that every layer can raise them.

`InputError` marks input a user can fix (a command-line argument, a config or data file): the
`megatron-rails` command prints its message as `megatron-rails CMD: error: ...` and exits 2, without a
traceback. Any other exception reaching the command is a bug and keeps its traceback.
"""


class InputError(ValueError):
    """Bad input: an argument, a config or a data file. Its message names the argument (or file and
    key) and what is allowed."""


class PlanError(ValueError):
    """A placement or plan violates the plan model's invariants."""


class ChildFailed(RuntimeError):
    """A launched run (torchrun training, trace recording) exited non-zero; the message carries the
    tail of its output, which is what a user needs to see (not our traceback)."""

"""One exception tree for the whole project.

Every error raised on purpose derives from `ParadecodeError`. Each class carries the process exit
code the command-line tools use for it, so a CLI maps an error to an exit code in one place.
A user's mistake gets a message that says what was given, what was expected and how to fix it.
"""


class ParadecodeError(Exception):
    """Root of every error paradecode raises on purpose."""

    exit_code = 1


class UserInputError(ParadecodeError, ValueError):
    """Bad input from the user: a wrong path, option or value. Exit code 2."""

    exit_code = 2


class UnsupportedModelError(UserInputError):
    """The model's architecture or one of its settings is not supported."""


class MissingDependencyError(ParadecodeError, ImportError):
    """An optional library or the hardware it needs is missing. Exit code 3."""

    exit_code = 3


class ManifestError(ParadecodeError):
    """An export folder is incomplete, corrupt or from an incompatible version. Exit code 2."""

    exit_code = 2


class ValidationError(ParadecodeError):
    """An exported subgraph does not reproduce its PyTorch reference within tolerance."""

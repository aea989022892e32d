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


class ModelClosedError(UserInputError):
    """A call on a model after its `close()`."""


class SchedulerStallError(ParadecodeError):
    """The ParaDecode scheduler made no progress for too long (a bug: the message names what it waited for)."""


def run_command(prog: str, work, interrupted: str = "interrupted") -> tuple[int, object]:
    """Run a command's `work()`; map paradecode errors to their exit codes with one message on stderr.

    Returns (exit code, what `work` returned or None). Every command-line tool goes through here,
    so they all report a user's mistake the same way: "PROG: error: MESSAGE" and exit code 2.
    """
    import sys

    try:
        return 0, work()
    except ParadecodeError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return err.exit_code, None
    except KeyboardInterrupt:
        print(f"{prog}: {interrupted}", file=sys.stderr)
        return 130, None

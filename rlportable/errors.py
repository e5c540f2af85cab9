"""Errors a user sees: one line that names the problem, never a deep stack trace."""


class RlpError(Exception):
    """Base of every error rlportable raises on purpose; the CLI prints its message."""

    exit_code = 1


class BackendUnavailable(RlpError):
    """The asked-for device backend cannot run here (package, driver or device missing)."""

    exit_code = 2


class ContractError(RlpError):
    """A contract file is missing, malformed, or names a piece that does not exist."""


class InputError(RlpError):
    """An op was given arrays of the wrong shape, dtype or size."""


class KernelCompileError(RlpError):
    """A kernel source failed to compile; the message carries the compiler log."""

"""User-facing errors: each one names the cause and the fix, and the CLI prints it without a traceback."""


class UserError(Exception):
    """A failure the user caused and can fix (bad path, bad key, bad data, missing checkpoint)."""


class ConfigError(UserError, ValueError):
    """A config key, value or file is wrong."""


class DataError(UserError):
    """Input or prepared data is missing, malformed, or does not match the checkpoint."""


class CheckpointError(UserError):
    """A checkpoint is missing, corrupt, or of another format version."""


class Stopped(KeyboardInterrupt):
    """A second stop signal: exit at once with 128 + `signum` (the checkpoints already written are intact)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

"""Errors a user can cause. The CLI and the service turn these into clear messages, never tracebacks."""


class UserError(ValueError):
    """A bad config, checkpoint, flag or request. The message names the field and what is allowed."""


class ConfigError(UserError):
    """A config file or config field is invalid."""

"""Errors a user can cause. The CLI and the service turn these into clear messages, never tracebacks."""

import re


class UserError(ValueError):
    """A bad config, checkpoint, flag or request. The message names the field and what is allowed."""


class ConfigError(UserError):
    """A config file or config field is invalid."""

    @property
    def field(self) -> str | None:
        """The field the message names first ("field 'x' must ..."), if any."""
        m = re.search(r"'([A-Za-z_][\w.\[\]]*)'", str(self))
        return m.group(1) if m else None

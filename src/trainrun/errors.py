"""Bad input: errors the user fixes. The CLI prints them as one line and exits 2."""


class UserError(Exception):
    """Base of every error caused by input (config, data, checkpoint, flags), not by a bug."""

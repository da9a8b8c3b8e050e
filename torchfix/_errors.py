"""What torchfix warns and raises: its own classes, below every layer (the cache warns as the lifecycle does)."""


class TorchfixWarning(UserWarning):
    """A fix could not be applied (torch was left untouched for it), or a setting was not understood."""


class TorchfixError(RuntimeError):
    """Raised instead of :class:`TorchfixWarning` when ``TORCHFIX_STRICT=1``."""

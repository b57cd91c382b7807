"""Exceptions raised by confkv. Every message names the problem and the fix."""


class ConfKVError(Exception):
    """Base class of confkv's own errors."""


class ConfigError(ConfKVError, ValueError):
    """A configuration value (or combination) is invalid; the message names the field."""


class UnsupportedModelError(ConfKVError, ValueError):
    """The model's architecture or usage is not supported by the transformers adapter."""


class PromptTooLongError(ConfKVError, ValueError):
    """The prompt plus the tokens to generate exceed the model's positions."""


class ModelLoadError(ConfKVError, RuntimeError):
    """A model could not be loaded; the message names the problem and the fix."""

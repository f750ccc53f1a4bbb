"""The one exception of a bad configuration, shared by the model, the layout checks and the run config."""


class ConfigError(ValueError):
    """A model or run configuration that cannot be built; the message names the field."""

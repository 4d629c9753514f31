"""Errors the pipeline raises for bad input.

Each one carries a message meant to be printed as a single line by the CLI; `QuantError` is the only
family the CLI turns into a clean exit, anything else is a bug and keeps its traceback.
"""


class QuantError(Exception):
    """Base class: a user-facing problem with the input, never a bug."""


class ModelSourceError(QuantError):
    """The model path, GGUF file or hub id cannot be used."""


class CalibrationError(QuantError):
    """The calibration data is missing, empty or too short."""


class ArtifactError(QuantError):
    """An artifact directory is damaged, foreign, from a newer format or cannot be written."""


class ConfigError(QuantError):
    """An option has a value outside what it accepts."""


class UnsupportedModelError(QuantError):
    """An architecture, layer shape or model feature that the engine or the pipeline does not implement."""


class QualityGateError(QuantError):
    """A build's measured quality missed the gate it was given (--max-dppl / --max-kl): nothing was published."""

"""quantserve's offline pipeline and artifact format."""

__version__ = "0.1.0"


def load(path, dtype=None, device="cpu", verify=True):
    """Load a quantserve artifact; see `quant.runtime.loader.load`."""
    from quant.runtime.loader import load as _load

    return _load(path, dtype=dtype, device=device, verify=verify)

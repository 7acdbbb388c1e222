"""hostagent: lends idle passthrough GPUs to a Kubernetes worker VM."""

import functools


@functools.cache
def version() -> str:
    """The installed distribution's version (what pip or the Nix build put there); read
    when first asked, so that importing the package stays cheap."""
    import importlib.metadata
    try:
        return importlib.metadata.version("hostagent")
    except importlib.metadata.PackageNotFoundError:  # a source tree, not installed
        return "unknown"

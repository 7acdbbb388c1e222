"""hostagent: lends idle passthrough GPUs to a Kubernetes worker VM."""

import functools
import warnings

# asyncssh (2.24) reads cryptography's DSA classes at import, which cryptography 51
# deprecates with a warning; hostagent makes and accepts no DSA key, and the line would
# reach the journal at every start.
warnings.filterwarnings("ignore", message="DSA is deprecated", module=r"asyncssh\.")


@functools.cache
def version() -> str:
    """The installed distribution's version (what pip or the Nix build put there); read
    when first asked, so that importing the package stays cheap."""
    import importlib.metadata
    try:
        return importlib.metadata.version("hostagent")
    except importlib.metadata.PackageNotFoundError:  # a source tree, not installed
        return "unknown"

"""oomtune: find the largest PyTorch training configuration that fits in memory, then train with it.

`oomtune.probe`, `oomtune.estimate` and `oomtune.check` are the commands as functions (oomtune/api.py);
`oomtune.OomtuneError` is what they raise for bad input."""

__version__ = "0.1.0"

__all__ = ["OomtuneError", "check", "estimate", "probe"]


def __getattr__(name: str):
    """The API, imported on first use (torch with it), so that `import oomtune` stays light."""
    if name in ("probe", "estimate", "check", "api"):
        import importlib

        api = importlib.import_module(".api", __name__)  # (`from . import api` would ask this function again)
        return api if name == "api" else getattr(api, name)
    if name == "OomtuneError":
        from .errors import OomtuneError

        return OomtuneError
    raise AttributeError(f"module 'oomtune' has no attribute {name!r}")

# Not a copy of torchtitan/config/__init__.py (which pulls in the trainer's
# ConfigManager); it only re-exports what the copied model code imports from
# ``torchtitan.config``.
from .configurable import Configurable

__all__ = ["Configurable"]

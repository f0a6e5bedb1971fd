"""Package names that import their module on first use (PEP 562).

`tfgpt` and `tfgpt.finetuning` export names whose modules import
TensorFlow; loading them on first use keeps `import tfgpt.config` and every
command's `--help` free of it.

Example:
>>> __getattr__, __dir__ = lazy_exports("mypackage", {"sqrt": "math"})
>>> __getattr__("sqrt")(9.0)
3.0
"""

import importlib
import sys


def lazy_exports(package, exports):
    """`(__getattr__, __dir__)` for `package`, whose names `exports` maps to modules."""

    def __getattr__(name):
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        module = sys.modules.get(package)
        return sorted(set(vars(module) if module else ()) | set(exports))

    return __getattr__, __dir__

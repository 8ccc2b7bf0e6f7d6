"""Numba's disk cache, checked against every kernel source instead of each kernel's own file.

Numba keeps a compiled kernel valid for as long as the file that defines it is unchanged. But a kernel compiles
into itself what it calls from other files (an inlined dot product, an exponential, a constant such as
quant.BLOCK), so after an edit or an upgrade of one of those a cached kernel would keep the old copy and quietly
disagree with code compiled afresh (seen: block.py's cached blocks kept an old softmax sum of attention_kernels.py
and their logits stopped matching the op-by-op path's). Here the stamp Numba compares is a hash of all the files
the kernels are built from, so a change to any of them compiles every kernel again. Where the cache lives is
unchanged (`__pycache__` beside the sources, or NUMBA_CACHE_DIR).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from numba.core import caching

_PACKAGE = Path(__file__).resolve().parent
# the kernels and the two modules whose constants and layouts they compile in
SOURCES = (*sorted(_PACKAGE.glob("*.py")), _PACKAGE.parent / "quant.py", _PACKAGE.parent / "kv_cache.py")


def sources_stamp() -> str:
    """sha256 over the names and bytes of SOURCES, in order."""
    digest = hashlib.sha256()
    for path in SOURCES:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


STAMP = sources_stamp()


def _keyed_by_the_sources(locator):
    """A subclass of Numba's cache locator class `locator` for files of this package, stamped with STAMP."""
    class Locator(locator):
        def get_source_stamp(self):
            return STAMP

        @classmethod
        def from_function(cls, py_func, py_file):
            if Path(py_file).resolve().parent != _PACKAGE:
                return None                                  # anyone else's cached functions: Numba's own rule
            return super().from_function(py_func, py_file)
    Locator.__name__ = Locator.__qualname__ = f"TinyllmKernels{locator.__name__}"
    return Locator


def install() -> None:
    """Put the keyed locators first in the list Numba asks (once per process; before any kernel is defined)."""
    classes = (getattr(caching, "CacheImpl", None) or caching._CacheImpl)._locator_classes   # (older Numba)
    if not any(c.__name__.startswith("TinyllmKernels") for c in classes):
        classes[:0] = [_keyed_by_the_sources(c) for c in (caching.UserProvidedCacheLocator,
                                                           caching.InTreeCacheLocator, caching.UserWideCacheLocator)]

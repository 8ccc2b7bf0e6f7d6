"""Which instructions the kernels are compiled for: the host's, or AVX2 without AVX-512 (TINYLLM_ISA=avx2).

TINYLLM_ISA=avx2 on a CPU with AVX-512 builds the kernels as for one with AVX2 only (AMD Zen 2/3): Numba's target
loses the AVX-512, AVX-VNNI and AMX features, so LLVM has 16 vector registers of 8 floats as there, and intdot.py,
int8_tiles.py and register_tiles.py take their AVX2 versions. That is how the AVX2 paths are tested and timed on
an AVX-512 machine (an emulation: the instructions are AVX2's, the core is not). It must be set before the kernels
are imported; Numba's disk cache keeps the two builds apart (its key holds the target's features).
Left out: choosing an instruction set per kernel, and any other forced target (NUMBA_CPU_NAME builds a portable one).
"""
from __future__ import annotations

import os

import llvmlite.binding as llvm
from numba import config
from numba.core.registry import cpu_target

CHOICES = ("native", "avx2")
ISA = os.environ.get("TINYLLM_ISA", "") or "native"
_NOT_ON_AVX2 = ("avx512", "avx10", "amx", "avxvnni", "avxifma", "avxneconvert", "evex512")   # feature-name prefixes


def _enabled(flags: str) -> set[str]:
    """LLVM's "+a,-b,..." feature string -> the names turned on."""
    return {f[1:] for f in flags.split(",") if f.startswith("+")}


def _force_avx2() -> None:
    """Numba's target <- the host's features without AVX-512 and its kin, before anything is compiled."""
    host = llvm.get_host_cpu_features()                                 # {name: on}
    if not host.get("avx2"):
        raise RuntimeError("TINYLLM_ISA=avx2: this CPU has no AVX2; unset TINYLLM_ISA")
    if "_toplevel_target_context" in cpu_target.__dict__:                 # Numba's compiler already exists
        raise RuntimeError("TINYLLM_ISA=avx2 must be set before Numba compiles anything: import tinyllm first")
    flags = ",".join(("+" if on and not name.startswith(_NOT_ON_AVX2) else "-") + name for name, on in host.items())
    config.CPU_FEATURES = os.environ["NUMBA_CPU_FEATURES"] = flags   # (the environment too: Numba reloads from it)


if ISA not in CHOICES:
    raise ValueError(f"TINYLLM_ISA={ISA!r}: expected one of {', '.join(CHOICES)}, or unset (the host's)")
if ISA == "avx2" and not config.DISABLE_JIT:
    _force_avx2()

# The features the kernels compile for: none in a portable build (NUMBA_CPU_NAME without NUMBA_CPU_FEATURES)
if config.DISABLE_JIT:
    FEATURES: set[str] = set()
elif config.CPU_FEATURES is not None:
    FEATURES = _enabled(config.CPU_FEATURES)
else:
    FEATURES = set() if config.CPU_NAME else _enabled(llvm.get_host_cpu_features().flatten())

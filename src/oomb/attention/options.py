"""KernelOptions: the switches of the attention kernels and the page copies (oomb.KernelOptions).

Here, below the kernels that read them, so that a launcher given no options takes these
defaults; oomb.config.EngineConfig carries one.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelOptions:
    """Switches of the Triton kernels and the page copies, for A/B runs; the defaults are the
    fastest measured (docs/experiments.md). Each one only turns a faster path off."""

    tma: bool = True  # page and query tiles through tensor descriptors (Hopper's TMA unit)
    dq_tma: bool = True  # ... in the dQ kernel's page loop (needs tma)
    dkdv_tma: bool = True  # ... for the dK/dV pages kernel's query tiles (needs tma)
    gluon: bool = True  # on Hopper, dense pages' backward in the fused Gluon kernel (paged_hopper.py)
    copy_engines: bool = True  # host pages move by the driver's batched copy where it has one (memory/dma.py)
    cpu_flash: bool = True  # the torch backend on the CPU attends through torch's fused op (attention/cpu_flash.py)

    #: the environment variables of `from_env`, for each field (0 turns the path off)
    ENV = {"tma": "OOMB_TMA", "dq_tma": "OOMB_DQ_TMA", "dkdv_tma": "OOMB_DKDV_TMA", "gluon": "OOMB_GLUON",
           "copy_engines": "OOMB_DMA", "cpu_flash": "OOMB_CPU_FLASH"}

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "KernelOptions":
        """The options the OOMB_* variables of `environ` (os.environ, at the command line's edge)
        ask for (unset: on)."""
        return cls(**{name: environ.get(var, "1") != "0" for name, var in cls.ENV.items()})

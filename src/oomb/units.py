"""Sizes written the way people write them: tokens ('64K', '1M') and bytes ('139.8GiB', '80GB'),
as argparse types (an error naming the text), and lists of layers ('-2,-1'). Read by the command
line, the sparse policies' settings and the benchmarks."""
from __future__ import annotations

import argparse
import math


def parse_tokens(text: str, low: int = 1) -> int:
    """'1M' -> 1048576, '64K' -> 65536, '4096' -> 4096: a whole number of tokens >= low (an
    argparse error naming the text otherwise: inf, nan, 0, negative, fractional, not a number)."""
    t = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < low or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens >= {low}; use e.g. 4096, 64K "
                                         "or 1M")
    return int(value)


def parse_bytes(text: str) -> int:
    """'139.8GiB', '512MiB', '80GB' -> bytes."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "TB": 10**12, "B": 1}
    t = text.strip().upper()
    for unit in sorted(units, key=len, reverse=True):
        if t.endswith(unit):
            try:
                value = float(t[: -len(unit)]) * units[unit]
            except ValueError:
                break
            if math.isfinite(value) and value >= 0:
                return int(value)
            break
    raise argparse.ArgumentTypeError(f"{text!r} is not a size; use e.g. 139.8GiB, 512MiB or 80GB")


def parse_layers(text: str) -> tuple[int, ...]:
    """'-2,-1' -> (-2, -1)."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"sparse_dense_layers={text!r} must be comma-separated layer indices, e.g. -2,-1") from None

"""Human-readable numbers for the CLI's tables (JSON output keeps raw numbers)."""

from __future__ import annotations


def human(value: float, unit: str = "", base: int = 1000) -> str:
    prefixes = ["", "K", "M", "G", "T", "P", "E"]
    if base == 1024:
        prefixes = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"]
    i = 0
    while abs(value) >= base and i < len(prefixes) - 1:
        value /= base
        i += 1
    text = f"{value:.0f}" if i == 0 else f"{value:.3g}"
    return f"{text} {prefixes[i]}{unit}".strip()


def human_bytes(nbytes: float) -> str:
    return human(nbytes, "B", base=1024)

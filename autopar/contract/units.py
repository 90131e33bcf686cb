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


def human_time(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale or unit == "µs":
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds} s"


def span(names: list[str]) -> str:
    """'wte…h.1', 'h.2…h.3' -> 'wte … h.3': the first and last module of a run of layers."""
    first, last = names[0].split("…")[0], names[-1].split("…")[-1]
    return first if first == last else f"{first} … {last}"


def printable(text: str) -> str:
    """`text` with every control or format character written as its escape (`\\x1b`), so a name
    read from a file is shown, never interpreted by the terminal."""
    return "".join(c if c.isprintable() or c == " " else ascii(c)[1:-1] for c in str(text))

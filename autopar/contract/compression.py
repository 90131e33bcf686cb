"""The gradient compression a plan names: the spec users write ("dgc:0.999,warmup=25"), its
defaults and the rules of each method that the planner prices and the runtime runs alike (which
tensors DGC sparsifies, its warm-up's density, which methods keep the momentum themselves).
Pure Python: the cost models import it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.contract.errors import AutoparError

METHODS = ("fp16", "topk", "randk", "dgc", "powersgd", "onebit", "threshold", "terngrad", "qsgd", "signsgd")
EXAMPLES = "fp16, topk:0.01, randk:0.01, dgc:0.999, powersgd:2, onebit, threshold:0.01, terngrad, qsgd:16, signsgd"
# Deep Gradient Compression's warm-up (Lin et al. 2018, §3.4): the density falls exponentially over
# DGC_STAGES stages before the final sparsity, as its reference code computes it (density_k =
# final^((k+1)/(stages+1)): 74.9 %, 93.7 %, 98.4 %, 99.6 % for a final 99.9 %, the paper's figures).
# The paper spends four epochs on it; the runtime counts steps, so a stage lasts `warmup` steps.
DGC_STAGES = 4
DGC_WARMUP_STEPS = 25
# DGC's local gradient clipping (§3.3): each rank clips before accumulating, at the training's global
# threshold scaled by N^(-1/2). The paper takes the threshold from the model's own training; 1.0 is
# what torchtitan (max_norm), nanoGPT (grad_clip) and Megatron-LM (clip-grad) use. The runtime clips
# each gradient tensor (GRACE's DGC memory clips per tensor too), `clip=0` not at all. Without it DGC
# 99.9 % collapsed on the digits CNN at lr 0.1, batch 64, 800 steps: to chance in 5 of 6 runs (3
# seeds, 2 and 4 ranks; a doubled warm-up did not help), to 88 % in the sixth; clipped, it ended
# within a point of dense in all six
DGC_CLIP = 1.0
# PowerSGD's dense start: plain all-reduces for the first `start` steps. torch's hook defaults to
# 1,000 (`start_powerSGD_iter`) and its docs advise about 10 % of training; our runs are 600-1,000
# steps, so 100: the same 100 steps DGC spends warming its sparsity up (4 stages of 25)
POWERSGD_START = 100
# 1-bit SGD's dense start: its default form compresses the momentum with error feedback as 1-bit Adam
# does (Tang et al. 2021), which first runs uncompressed through a warm-up stage; DeepSpeed's 1-bit
# Adam tutorial advises 15-25 % of the training steps (`freeze_step`). 120 is 15 % of the sweep's
# 800 steps. Without it 1-bit SGD lost 1.11 points on the digits CNN in one of 24 settings (4 ranks,
# batch 256, lr 0.1, seed 0); with it its worst was -0.44 there and 0.00 on the MLP
ONEBIT_START = 120
# which gradients travel compressed (`cost_models.compression.compresses`): at least `min_size`
# elements, and shrunk at least `min_rate` times on the wire. torch's PowerSGD hook leaves a tensor
# dense where compression saves less than 2× (`min_compression_rate`); the size floor keeps the
# small layers dense, as DGC's reference code keeps biases (and warns where a layer would send one
# element): below 4,096 elements (16 KiB in fp32) dense costs little, while DGC at 99.9 % would send
# at most 4 of them a step
MIN_SIZE = 4096
MIN_RATE = 2.0
# options every method reads, and each method's own, at their defaults (a plan records them
# written out: `canonical`)
COMMON: dict[str, float] = {"min_size": MIN_SIZE, "min_rate": MIN_RATE}
DEFAULTS: dict[str, dict[str, float]] = {
    "dgc": {"momentum": 0.9, "warmup": DGC_WARMUP_STEPS, "clip": DGC_CLIP},
    "topk": {"warmup": DGC_WARMUP_STEPS},  # DGC's exponential warm-up of the density
    "powersgd": {"start": POWERSGD_START},
    "onebit": {"momentum": 0.9, "start": ONEBIT_START},
    "terngrad": {"clip": 2.5},
}


@dataclass
class Spec:
    method: str
    arg: float | None
    options: dict[str, float]
    text: str

    def option(self, key: str) -> float:
        return self.options.get(key, {**COMMON, **DEFAULTS.get(self.method, {})}.get(key, 0.0))

    def canonical(self) -> str:
        """The spec with every default option written out, so a plan says what ran."""
        options = {**COMMON, **DEFAULTS.get(self.method, {}), **self.options}
        return ",".join([self.text.split(",")[0]] + [f"{k}={int(v) if v == int(v) else v!r}"
                                                     for k, v in sorted(options.items())])


def carries_momentum(spec: Spec) -> bool:
    """DGC (momentum correction) and 1-bit SGD (its momentum compressed with error feedback, as
    1-bit Adam does; not without error feedback) keep the momentum on each rank and send from it:
    the optimizer must have none."""
    return spec.method == "dgc" or (spec.method == "onebit" and spec.option("momentum") > 0
                                    and spec.options.get("ef", 1) != 0)


def runs_dense(spec: Spec, compresses_any: bool) -> bool:
    """Whether a compressor runs as dense averaging does, through the plain synchroniser overlapped
    with backward: where it compresses no gradient (`compresses_any` False: the cost model found
    none worth it on the link). DGC and 1-bit SGD keep the momentum for every gradient, dense ones
    too: the synchroniser then clips each rank's gradient before sending it (DGC's local clipping)
    and applies their momentum to the average, which equals averaging each rank's (it is linear).
    Not signSGD: its step is a majority vote on every gradient, dense ones too, never an average."""
    return not compresses_any and spec.method != "signsgd"


def dgc_density(sparsity: float, warmup: float, step: int) -> float:
    """The fraction of a gradient DGC (and top-k) sends at `step`: the warm-up's stages, then
    1 − sparsity."""
    stage = min(step // warmup, DGC_STAGES) if warmup else DGC_STAGES
    return (1 - sparsity) ** ((stage + 1) / (DGC_STAGES + 1))


def dense_start(spec: Spec, step: int) -> bool:
    """Whether every gradient travels dense at `step`: PowerSGD's first `start` steps (torch's
    hook's `start_powerSGD_iter`), 1-bit SGD's (1-bit Adam's warm-up stage)."""
    return step < spec.option("start")


def matrix(shape: tuple[int, ...]) -> bool:
    """Compressors take weight matrices (two or more dimensions); biases and norms travel dense, as
    DGC's reference code and torch's PowerSGD hook keep them."""
    return len(shape) > 1


def parse(text: str) -> Spec:
    """`name[:value][,key=value...]`, e.g. "dgc:0.999,warmup=100", "topk:0.01,ef=0"."""
    head, *rest = text.split(",")
    name, _, arg = head.partition(":")
    if name not in METHODS:
        raise AutoparError(f"unknown compression {text!r}: use one of {EXAMPLES}")
    try:
        value = float(arg) if arg else None
        options = {k: float(v) for k, v in (o.split("=", 1) for o in rest)}
    except ValueError:
        raise AutoparError(f"compression {text!r}: values must be numbers, as in dgc:0.999,warmup=100") from None
    if not all(math.isfinite(v) for v in [*options.values(), *([value] if value is not None else [])]):
        raise AutoparError(f"compression {text!r}: values must be finite numbers, as in dgc:0.999,warmup=100")
    a = value
    if name in ("topk", "randk") and not (a and 0 < a <= 1):
        raise AutoparError(f"compression {text!r}: give the fraction kept, e.g. {name}:0.01")
    if name == "dgc" and not (a is not None and 0 <= a < 1):
        raise AutoparError(f"compression {text!r}: give the final sparsity in [0, 1), e.g. dgc:0.999")
    if name == "qsgd" and a is not None and not 1 <= a <= 127:
        raise AutoparError(f"compression {text!r}: levels must be 1 to 127 (they travel in int8)")
    if name == "powersgd" and a is not None and (a < 1 or a != int(a) or a > 4096):
        raise AutoparError(f"compression {text!r}: the rank must be a positive integer, e.g. powersgd:2")
    if name == "threshold" and not (a and a > 0):
        raise AutoparError(f"compression {text!r}: give the threshold τ, e.g. threshold:0.01")
    if options.get("warmup", 0) < 0 or not 0 <= options.get("momentum", 0) < 1:
        raise AutoparError(f"compression {text!r}: warmup is a number of steps ≥ 0 and momentum in [0, 1), "
                           "e.g. dgc:0.999,warmup=25,momentum=0.9")
    if options.get("start", 0) < 0 or options.get("min_size", 0) < 0 or options.get("min_rate", 1) < 0:
        raise AutoparError(f"compression {text!r}: start (dense steps first), min_size (elements) and min_rate "
                           "(times smaller on the wire) are numbers ≥ 0, e.g. powersgd:2,start=100,min_size=4096")
    if "masking" in options and (name != "dgc" or options["masking"] not in (0, 1)):
        raise AutoparError(f"compression {text!r}: masking= is DGC's momentum factor masking, 1 (on, the "
                           "default) or 0 (off), e.g. dgc:0.999,masking=0")
    if "start" in options and name not in ("powersgd", "onebit"):
        raise AutoparError(f"compression {text!r}: start= (dense steps first) is PowerSGD's and 1-bit SGD's; "
                           + ("DGC and top-k warm their density up instead (warmup=STEPS per stage)"
                              if name in ("dgc", "topk") else f"{name} starts compressed"))
    return Spec(name, value, options, text)

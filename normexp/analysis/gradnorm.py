"""Gradient norms at init, summarised: per-block (FFN toy) and per-layer (Transformer) means over seeds,
fitted slopes and growth verdicts. The measurements themselves are `normexp.diagnostics`' (torch)."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from normexp.config import ModelConfig, RunConfig, flatten, key_label


def fit_slope(depths: list[float], values: list[float]) -> float:
    """Least-squares slope of log(value) against log(depth)."""
    xs, ys = [math.log(v) for v in depths], [math.log(v) for v in values]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else math.nan



GROWTH_FACTOR = 1.5  # last layer / first layer: above it "grows", below its inverse "shrinks", else "flat"



SUBLAYERS = {"attn_out_grad": "attention out", "ffn_out_grad": "FFN fc2"}



@dataclass(frozen=True)
class LayerGradnorm:
    """Per variant and sublayer: the gradient norm at each layer (mean, std over seeds), and the ratio
    of the variant's last layer's mean to its first's with its verdict (grows / flat / shrinks). With
    several depths each depth is a variant of its own (`post L=4`, `post L=8`); `layers` runs to the
    deepest, and a shallower variant's entries past its own depth are (nan, nan): it has no such layer."""

    layers: list[int]
    grads: dict[str, dict[str, list[tuple[float, float]]]]  # variant -> sublayer column -> [(mean, std)]
    seeds: int = 1  # the seeds each mean pools
    depths: tuple[int, ...] = ()  # the depths of the sweep, shallowest first (each its own variants if several)

    def _own(self, variant: str, column: str) -> list[tuple[float, float]]:
        """The variant's entries for the layers its model has."""
        return [entry for entry in self.grads[variant][column] if not math.isnan(entry[0])]

    def ratio(self, variant: str, column: str) -> float:
        stats = self._own(variant, column)
        return stats[-1][0] / stats[0][0] if stats and stats[0][0] > 0 else math.nan

    def verdict(self, variant: str, column: str) -> str:
        if len(self._own(variant, column)) < 2:  # last/first is 1 by construction
            return "no verdict: needs 2 layers or more"
        return growth_verdict(self.ratio(variant, column))



def growth_verdict(ratio: float) -> str:
    """'grows', 'shrinks' or 'flat' for a last-to-first layer ratio (GROWTH_FACTOR either way)."""
    if math.isnan(ratio):
        return "undefined"
    return "grows" if ratio > GROWTH_FACTOR else "shrinks" if ratio < 1 / GROWTH_FACTOR else "flat"



def summarise_layer_gradnorm(rows: list[dict]) -> LayerGradnorm:
    """Pool seeds per variant (rows' `variant`) and layer; with several depths, per variant and depth
    (`<variant> L=<depth>`), each over its own layers: no depth is left out."""
    depths = sorted({int(r["depth"]) for r in rows})
    layers = list(range(1, depths[-1] + 1))
    grads: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for variant in dict.fromkeys(r.get("variant", r["placement"]) for r in rows):
        for depth in depths:
            mine = [r for r in rows if r.get("variant", r["placement"]) == variant and int(r["depth"]) == depth]
            if not mine:
                continue
            name = f"{variant} L={depth}" if len(depths) > 1 else variant
            grads[name] = {}
            for column in SUBLAYERS:
                stats = []
                for layer in layers:
                    values = [r[column] for r in mine if r["layer"] == layer]
                    stats.append((statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan)
                                 if values else (math.nan, math.nan))
                grads[name][column] = stats
    return LayerGradnorm(layers, grads, len({r["seed"] for r in rows}), tuple(depths))



@dataclass(frozen=True)
class GradnormSummary:
    """Per placement: the last block's fc2 gradient at each depth (mean, std over seeds), the
    fitted log-log slope, and the hidden-state norms at the largest depth."""

    depths: list[int]
    last_grad: dict[str, list[tuple[float, float]]]  # placement -> [(mean, std)] per depth
    slopes: dict[str, float]
    stream_sq: dict[str, list[float]]  # placement -> ||x_l||^2/d per block, deepest model, mean over seeds
    norm_in_sq: dict[str, list[float]]  # placement -> ||u_l||^2/d entering each block's norm
    branch_gain: float | None  # c = E||F(x)||^2/d for unit-variance input, from the init; None if unknown
    seeds: int = 1  # the seeds each mean pools

    def measured_gain(self, placement: str) -> float:
        """c as the data show it: Post-LN, mean ||u||^2/d - 1; otherwise the per-block growth of ||x_l||^2/d."""
        if placement.split()[0] == "post":
            return statistics.fmean(v for v in self.norm_in_sq[placement] if not math.isnan(v)) - 1
        stream = self.stream_sq[placement]
        if len(stream) < 2:  # a growth per block needs two blocks
            return math.nan
        blocks = list(range(1, len(stream) + 1))
        mx, my = statistics.fmean(blocks), statistics.fmean(stream)
        return sum((b - mx) * (v - my) for b, v in zip(blocks, stream)) / sum((b - mx) ** 2 for b in blocks)



def branch_gain(model: ModelConfig) -> float | None:
    """E||F(x)||^2 / d of one FFN branch at init for E x_i^2 = 1: xavier weights (variance 2/(fan_in +
    fan_out)), zero biases, ReLU halving the second moment, hidden = m d: 2m / (1 + m)^2. Xiong et
    al.'s setting (weights N(0, 1/d), equal widths) gives 1/2, hence their 3/2 and 1 + l/2."""
    if model.init not in ("xavier_uniform", "xavier_normal"):
        return None
    m = model.hidden_mult
    return 2 * m / (1 + m) ** 2



def gradnorm_variant(cfg: RunConfig, keys: Sequence[str]) -> str:
    """The variant a gradnorm row belongs to: its placement, then `leaf=value` for each other grid axis
    in `keys` (depth and seed excepted), so that only seeds are ever pooled into one mean ± std."""
    flat = flatten(cfg)
    others = [k for k in keys if k not in ("norm.placement", "model.depth", "seed")]
    return " ".join([cfg.norm.placement, *(f"{key_label(k)}={json.dumps(flat[k])}" for k in others)])



def summarise_gradnorm(rows: list[dict], model: ModelConfig | None = None) -> GradnormSummary:
    """Per variant (rows' `variant`, or their placement where rows carry none) and depth: the mean and
    std over seeds of the last block's gradient; the fitted slope; the deepest model's hidden norms."""
    variant = [r.get("variant", r["placement"]) for r in rows]
    placements = list(dict.fromkeys(variant))
    depths = sorted({int(r["depth"]) for r in rows})
    last_grad, slopes, stream, norm_in = {}, {}, {}, {}
    for placement in placements:
        mine = [r for r, v in zip(rows, variant) if v == placement]
        stats = []
        for depth in depths:
            values = [r["fc2_grad"] for r in mine if r["depth"] == depth and r["block"] == depth]
            stats.append((statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan))
        last_grad[placement] = stats
        slopes[placement] = fit_slope([float(d) for d in depths], [m for m, _ in stats])
        deepest = [r for r in mine if r["depth"] == depths[-1]]
        blocks = sorted({r["block"] for r in deepest})
        stream[placement] = [statistics.fmean(r["stream_sq"] for r in deepest if r["block"] == b) for b in blocks]
        norm_in[placement] = [statistics.fmean(r["norm_in_sq"] for r in deepest if r["block"] == b) for b in blocks]
    return GradnormSummary(depths, last_grad, slopes, stream, norm_in, branch_gain(model) if model else None,
                           len({r["seed"] for r in rows}))

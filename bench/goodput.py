"""Goodput of a request-rate sweep, after DistServe: the highest Poisson rate at which at least a given share
of requests meets a latency SLO (TTFT and the request's own ITL p95), the acceptance keys of issue 45 taken
from the sweep, and the plot of TTFT and ITL percentiles against rate. Used by bench/serve.py."""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PERCENTILES = (50, 95, 99)
# Top-level keys of a result file: (rate, metric, percentile) -> key, when that rate is in the sweep.
RATE_KEYS = {"rate8_itl_p95_ms": (8.0, "itl_ms", "p95"), "rate8_ttft_p50_ms": (8.0, "ttft_ms", "p50"),
             "rate20_itl_p95_ms": (20.0, "itl_ms", "p95"), "rate20_itl_p99_ms": (20.0, "itl_ms", "p99"),
             "rate20_ttft_p95_ms": (20.0, "ttft_ms", "p95")}


@dataclass(frozen=True)
class SLO:
    ttft_ms: float = 200.0
    itl_p95_ms: float = 25.0
    min_fraction: float = 0.9   # share of requests that must meet both

    def met_by(self, ok: bool, ttft_s: float, itl_s: list[float]) -> bool:
        """A request meets the SLO: it succeeded, its first token came in time, and the 95th percentile of
        its own gaps between tokens is within the bound (a request of one token has no gaps)."""
        if not ok or ttft_s * 1e3 > self.ttft_ms:
            return False
        return not itl_s or float(np.percentile(np.asarray(itl_s), 95)) * 1e3 <= self.itl_p95_ms


def attainment(slo: SLO, results) -> float:
    """The share of `results` (bench/serve.py's RequestResult) meeting `slo`; failed requests count against."""
    if not results:
        return 0.0
    return sum(slo.met_by(r.ok, r.ttft, r.itl) for r in results) / len(results)


def goodput(levels: dict, slo: SLO) -> float | None:
    """The highest finite swept rate whose SLO attainment reaches `slo.min_fraction`; None when none does."""
    passing = [float(rate) for rate, level in levels.items()
               if math.isfinite(float(rate)) and level["slo_attainment"] >= slo.min_fraction]
    return max(passing) if passing else None


def rate_keys(levels: dict) -> dict:
    """The RATE_KEYS whose rate was swept, with that level's percentile."""
    by_rate = {float(rate): level for rate, level in levels.items()}
    return {key: by_rate[rate][metric][stat] for key, (rate, metric, stat) in RATE_KEYS.items() if rate in by_rate}


def plot_rates(path: Path, runs: dict[str, dict], slo: SLO, title: str) -> bool:
    """TTFT and ITL percentiles and SLO attainment against request rate, one line style per run
    (e.g. the ITL target off and on), with the SLO's bounds drawn in."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG", file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    markers = ("o", "s", "^")
    for (label, levels), style in zip(runs.items(), ("-", "--", ":", "-.")):
        rates = [r for r in levels if math.isfinite(float(r))]
        xs = [float(r) for r in rates]
        for ax, metric in zip(axes[:2], ("ttft_ms", "itl_ms")):
            for p, marker in zip(PERCENTILES, markers):
                ys = [levels[r][metric][f"p{p}"] or float("nan") for r in rates]
                ax.plot(xs, ys, marker + style, label=f"{label} p{p}")
        axes[2].plot(xs, [100 * levels[r]["slo_attainment"] for r in rates], "o" + style, label=label)
    axes[0].axhline(slo.ttft_ms, color="grey", lw=1)
    axes[1].axhline(slo.itl_p95_ms, color="grey", lw=1)
    axes[2].axhline(100 * slo.min_fraction, color="grey", lw=1)
    for ax, name in zip(axes, ("TTFT (ms)", "ITL (ms)", "requests meeting the SLO (%)")):
        ax.set_title(name)
        ax.set_xlabel("request rate (requests/s, Poisson)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[:2]:
        ax.set_yscale("log")
    fig.suptitle(f"{title}; SLO: TTFT <= {slo.ttft_ms:g} ms, per-request ITL p95 <= {slo.itl_p95_ms:g} ms")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

"""Synthetic notebook traces that follow published production-notebook figures.

Every distribution is a *quantile-matched* one: the published quantiles are points of the inverse
CDF and the generator interpolates log-linearly between them (so each published p50/p90/p99 is met
exactly, and values between two points are log-uniform). Points marked "assumption" are ours; the
others are published figures of production notebook traces (NotebookOS, ASPLOS 2026).
docs/simulator.md lists them with their sources.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass

from .trace import Session, Trace

# (quantile, value) points of inverse CDFs, values in seconds
SESSION_LENGTH = (
    (0.0, 900.0),
    (0.1, 3600.0),
    (0.5, 21 * 3600.0),
    (0.9, 72 * 3600.0),
    (1.0, 168 * 3600.0),
)
# published: p50 5-6 min, p90 32 min, p99 7 h, "up to days"; minimum 60 s because the traces are
# binned at 60 s (sub-minute cells are modelled separately, SHORT_CELL)
LONG_CELL = (
    (0.0, 60.0),
    (0.5, 330.0),
    (0.9, 1920.0),
    (0.99, 7 * 3600.0),
    (0.999, 86400.0),
    (1.0, 3 * 86400.0),
)
# published: p50 3 min, p90 38 min; the tail beyond p90 is an assumption
THINK = ((0.0, 5.0), (0.5, 150.0), (0.9, 1200.0), (0.99, 2 * 3600.0), (1.0, 6 * 3600.0))
# assumptions: seconds-long cells (inspecting data, printing shapes, small edits) in quick bursts
SHORT_CELL = ((0.0, 0.2), (0.5, 3.0), (0.9, 20.0), (1.0, 59.0))
SHORT_THINK = ((0.0, 1.0), (0.5, 8.0), (0.9, 40.0), (1.0, 120.0))
# GPUs per session (assumption for the mix; the sizes 1/4/8 and CPU-only are published)
SESSION_GPUS = ((0, 0.10), (1, 0.55), (4, 0.25), (8, 0.10))


@dataclass
class GenConfig:
    sessions: int = 60
    hours: float = 48.0
    seed: int = 1
    busy_frac: float = (
        0.25  # GPU-busy / reserved GPU time per session (published: about 25%)
    )
    short_burst_mean: float = (
        1.0  # mean short cells before each long cell (assumption: half the cells)
    )
    long_cell_gpu_prob: float = (
        0.85  # a long cell of a GPU session uses its GPUs (else CPU-only)
    )
    short_cell_gpu_prob: float = 0.5  # same for short cells (assumption)


class Quantiles:
    """Inverse CDF through (q, value) points, log-linear between them."""

    def __init__(self, points):
        self.qs = [q for q, _ in points]
        self.logs = [math.log(v) for _, v in points]
        if self.qs[0] != 0.0 or self.qs[-1] != 1.0 or sorted(self.qs) != self.qs:
            raise ValueError("quantile points must run from 0 to 1")

    def value(self, u: float) -> float:
        i = bisect.bisect_right(self.qs, u) - 1
        if i >= len(self.qs) - 1:
            return math.exp(self.logs[-1])
        q0, q1 = self.qs[i], self.qs[i + 1]
        f = (u - q0) / (q1 - q0)
        return math.exp(self.logs[i] + f * (self.logs[i + 1] - self.logs[i]))

    def sample(self, rng: random.Random) -> float:
        return self.value(rng.random())


def _r(x: float) -> float:
    return round(x, 3)


def generate(cfg: GenConfig) -> Trace:
    if cfg.sessions < 0 or cfg.hours <= 0:
        raise ValueError("sessions must be >= 0 and hours > 0")
    rng = random.Random(cfg.seed)
    length_d = Quantiles(SESSION_LENGTH)
    long_d, think_d = Quantiles(LONG_CELL), Quantiles(THINK)
    short_d, sthink_d = Quantiles(SHORT_CELL), Quantiles(SHORT_THINK)
    horizon = cfg.hours * 3600.0
    sizes = [g for g, _ in SESSION_GPUS]
    weights = [w for _, w in SESSION_GPUS]
    p_short = 1.0 / (
        1.0 + cfg.short_burst_mean
    )  # geometric burst length with that mean
    width = max(3, len(str(max(cfg.sessions - 1, 0))))
    sessions = []
    for i in range(cfg.sessions):
        # sessions that fit in the window start anywhere they still fit (keeps the published length
        # median); longer ones are cut at the window's edges, as a trace window cuts them
        want = length_d.sample(rng)
        start = _r(rng.random() * max(0.0, horizon - want))
        end = _r(min(horizon, start + want))
        if end <= start:
            end = _r(start + 1.0)
        gpus = rng.choices(sizes, weights)[0]
        length = end - start
        target = (
            cfg.busy_frac * length
        )  # busy seconds, cells weighted by their share of the session's GPUs
        # 1) a compact sequence of cells (relative times), with the published think times
        rel = []  # (submit, duration, gpus)
        t = busy = 0.0
        while busy < target and t < length:
            n_short = 0
            while rng.random() > p_short:
                n_short += 1
            for _ in range(n_short):
                t += sthink_d.sample(rng)
                d = short_d.sample(rng)
                g = gpus if (gpus and rng.random() < cfg.short_cell_gpu_prob) else 0
                rel.append((t, d, g))
                busy += d * (g / gpus if gpus else 1.0)
                t += d
            t += think_d.sample(rng)
            d = long_d.sample(rng)
            g = gpus if (gpus and rng.random() < cfg.long_cell_gpu_prob) else 0
            w = d * (g / gpus if gpus else 1.0)
            if rel and busy + w - target > target - busy:
                break  # the session is closer to its busy target without this cell
            rel.append((t, d, g))
            busy += w
            t += d
        # 2) spread the session's remaining idle time over a few long "away" gaps (user gone),
        #    few enough (<= 1 in 20 gaps) to leave the think-time p50/p90 as published
        spare = length - t
        if spare > 0 and rel:
            k = min(1 + _poisson(rng, 2.0), max(1, len(rel) // 20))
            cuts = sorted(rng.random() for _ in range(k - 1))
            shares = [b - a for a, b in zip([0.0, *cuts], [*cuts, 1.0], strict=False)]
            slots = sorted(rng.randrange(len(rel) + 1) for _ in range(k))
            shifted = []
            shift = 0.0
            j = 0
            for idx, (s, d, g) in enumerate(rel):
                while j < k and slots[j] <= idx:
                    shift += shares[j] * spare
                    j += 1
                shifted.append((s + shift, d, g))
            rel = shifted
        cells = []
        last_end = start
        for s, d, g in rel:
            submit = _r(start + s)
            if submit >= end:
                break
            submit = max(submit, _r(last_end))
            dur = _r(min(d, end - submit))
            if dur <= 0 or submit >= end:
                break
            cells.append((submit, dur, g))
            last_end = submit + dur
        sessions.append(Session(f"s{i:0{width}d}", start, end, gpus, cells))
    return Trace(sessions)


def _poisson(rng: random.Random, lam: float) -> int:
    k, p, limit = 0, 1.0, math.exp(-lam)
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def trace_stats(trace: Trace) -> dict:
    """Summary figures of a trace, to compare with the published ones."""
    from .engine import percentile

    durs, thinks, lengths, long_thinks = [], [], [], []
    gpu_cells = {0: 0, 1: 0, 4: 0, 8: 0}
    for s in trace.sessions:
        lengths.append(s.end_s - s.start_s)
        prev_end = prev_long_end = None
        for t, d, g in s.cells:
            if d >= 60.0:
                if prev_long_end is not None:
                    long_thinks.append(max(0.0, t - prev_long_end))
                prev_long_end = t + d
            durs.append(d)
            gpu_cells[g] = gpu_cells.get(g, 0) + 1
            if prev_end is not None:
                thinks.append(max(0.0, t - prev_end))
            prev_end = t + d
    durs.sort()
    thinks.sort()
    long_thinks.sort()
    lengths.sort()
    long_durs = [d for d in durs if d >= 60.0]
    reserved = trace.reserved_gpu_seconds()
    return {
        "sessions": len(trace.sessions),
        "cells": len(durs),
        "session_length_p50_h": percentile(lengths, 50) / 3600,
        "cell_duration_p50_s": percentile(durs, 50),
        "long_cell_duration_p50_s": percentile(long_durs, 50),
        "long_cell_duration_p90_s": percentile(long_durs, 90),
        "long_cell_duration_p99_s": percentile(long_durs, 99),
        "short_cell_frac": (len(durs) - len(long_durs)) / len(durs) if durs else 0.0,
        "think_p50_s": percentile(thinks, 50),
        "think_p90_s": percentile(thinks, 90),
        "long_think_p50_s": percentile(long_thinks, 50),
        "long_think_p90_s": percentile(long_thinks, 90),
        "cells_by_gpus": gpu_cells,
        "busy_frac_of_reserved": (trace.busy_gpu_seconds() / reserved)
        if reserved
        else 0.0,
        "gpu_hours_reserved": reserved / 3600,
    }

"""Trace-driven simulator of gpuhub and its baselines (``gpuhub sim``); see docs/simulator.md."""

from .engine import POLICIES, SimConfig, SimError, SimResult, simulate
from .trace import Session, Trace, TraceError, load_trace, write_trace

__all__ = [
    "POLICIES",
    "Session",
    "SimConfig",
    "SimError",
    "SimResult",
    "Trace",
    "TraceError",
    "load_trace",
    "simulate",
    "write_trace",
]

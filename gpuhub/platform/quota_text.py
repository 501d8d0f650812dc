"""How GPU quotas are said to users, the same words wherever they read them: a refused cell
(gpuhub/agent/quota_gate.py), the spawn page (gpuhub/hub/spawner.py) and ``gpuhub quota``."""

from __future__ import annotations

# When this week's GPU-hours start again from zero (gpuhub/platform/weeks.py).
RESETS = "Monday 00:00 UTC"


def hours_text(hours: float) -> str:
    """GPU-hours as a user reads them: one decimal (``29.5``), two significant digits below 0.1."""
    return f"{hours:.1f}" if hours >= 0.1 or hours == 0 else f"{hours:.2g}"


def usage_line(status: dict) -> str:
    """One line for the spawn page and ``gpuhub quota``: ``GPU-hours this week: 3.2 of 30 (resets
    Monday 00:00 UTC); GPUs at once: up to 2``."""
    own = next((lim for lim in status["limits"] if lim["kind"] == "user"), None)
    hours = f"{status['gpu_hours_used']:.1f}"
    if own and own["gpu_hours"] is not None:
        hours += f" of {own['gpu_hours']:g}"
    parts = [f"GPU-hours this week: {hours} (resets {status['resets']})"]
    if own and own["gpus"] is not None:
        parts.append(f"GPUs at once: up to {own['gpus']}")
    for lim in status["limits"]:
        if lim["kind"] == "group":
            shared = f"{lim['name']}: {lim['gpu_hours_used']:.1f}"
            shared += f" of {lim['gpu_hours']:g} GPU-hours" if lim["gpu_hours"] is not None else " GPU-hours"
            if lim["gpus"] is not None:
                shared += f", up to {lim['gpus']} GPUs at once"
            parts.append(shared + " (shared)")
    return "; ".join(parts)

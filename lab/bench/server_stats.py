"""Where a request's time goes inside tritonserver: each composing model's queue + compute time, from
the server's statistics extension (cumulative nanoseconds per model, read before and after)."""

from __future__ import annotations

# The composing models whose time the breakdown shows (the ensemble's own time is their sum plus hand-offs;
# kimi_placeholder runs beside kimi_preprocess).
STEPS = ("kimi_placeholder", "kimi_preprocess", "moonvit3d")


def model_ns(stats: dict) -> dict[str, int]:
    """Cumulative queue + compute nanoseconds per model, from a statistics answer (as_json)."""
    out = {}
    for m in stats.get("model_stats", []):
        s = m.get("inference_stats", {})
        out[m["name"]] = sum(int(s.get(k, {}).get("ns", 0)) for k in ("queue", "compute_input", "compute_infer", "compute_output"))
    return out


def breakdown(before: dict[str, int], after: dict[str, int], requests: int = 1) -> str:
    """Each step's ms between two readings, per request over `requests`."""
    return ", ".join(f"{name} {(after.get(name, 0) - before.get(name, 0)) / 1e6 / requests:.1f}" for name in STEPS)

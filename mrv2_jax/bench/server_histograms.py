"""Quantiles of a running server's Prometheus histograms over one benchmark level: scrape /metrics
before and after, take the difference of the cumulative bucket counts, and interpolate inside the
bucket that holds the quantile (as Prometheus' histogram_quantile does)."""

from __future__ import annotations

import math
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Buckets = dict[float, float]  # upper bound ("le") -> cumulative count


def scrape(url: str, names: tuple[str, ...], by: str | None = None, timeout: float = 10.0) -> dict[str, Buckets]:
    """{histogram name: its cumulative bucket counts} for those of `names` on `url`/metrics
    (summed over label sets); with `by`, also each value of that label apart, as `name{by="value"}`."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as response:
        text = response.read().decode()
    found: dict[str, Buckets] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in names:
            continue
        buckets = found.setdefault(family.name, {})
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
                if by is not None and by in sample.labels:
                    part = found.setdefault(f'{family.name}{{{by}="{sample.labels[by]}"}}', {})
                    part[le] = part.get(le, 0.0) + sample.value
    return found


def count(before: Buckets | None, after: Buckets) -> float:
    """How many observations were made between the two scrapes."""
    return after.get(math.inf, 0.0) - (before or {}).get(math.inf, 0.0)


def quantile(before: Buckets | None, after: Buckets, q: float) -> float | None:
    """The q-quantile (0..1) of what was observed between the two scrapes, None if nothing was.
    Inside a bucket the observations are taken as spread evenly; in the last (+Inf) bucket the
    answer is its lower bound."""
    bounds = sorted(after)
    counts = [after[le] - (before or {}).get(le, 0.0) for le in bounds]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for le, cumulative in zip(bounds, counts):
        if cumulative >= rank:
            if math.isinf(le):
                return lower
            inside = cumulative - below
            return lower + (le - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = le, cumulative
    return lower

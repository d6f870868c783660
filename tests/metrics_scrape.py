"""Reading a Prometheus text exposition in tests."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    """Every sample of ``url`` keyed by (sample name, labels)."""
    text = httpx.get(url, timeout=10).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return total(after, name, **labels) - total(before, name, **labels)


def bucket_of(before: Samples, after: Samples, name: str, **labels: str) -> tuple[float, float]:
    """(lower, upper] edges of the histogram bucket that the one observation of ``name`` made
    between the two scrapes fell in."""
    les = sorted(
        {dict(ls)["le"] for (n, ls) in after if n == f"{name}_bucket" and set(labels.items()) <= ls},
        key=float,
    )
    counts = [delta(before, after, f"{name}_bucket", le=le, **labels) for le in les]
    first = counts.index(1)
    assert counts[first:] == [1] * (len(les) - first) and not any(counts[:first]), counts
    return (float(les[first - 1]) if first else 0.0), float(les[first])

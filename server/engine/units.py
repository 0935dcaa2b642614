"""Unit conversions and the precision numbers are reported with: definitions, not settings."""

from __future__ import annotations

SECONDS_PER_HOUR = 3600.0
SECONDS_PER_MINUTE = 60.0
PERCENT = 100.0  # a ratio 0-1 times this is a percentage
# Decimal places of an alert's evidence: three are a tenth of a percent of a ratio, a thousandth of a degree.
EVIDENCE_DIGITS = 3
# Decimal places of the per-job and per-node views (GPU-hours lost accrue in small steps).
VIEW_DIGITS = 4

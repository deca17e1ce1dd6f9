"""Measurements: the capacity benchmark, roofline, profiling, selection traces and cache-policy
replay (plots are drawn in :mod:`hisparse_cli`)."""

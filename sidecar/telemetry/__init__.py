"""Metrics and logs of the daemon."""

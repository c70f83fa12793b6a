"""Offline: read recorded traffic, report, diagnose, calibrate, compare experiments."""

"""Placeholder package: see the issues that build it."""

"""Helpers for testing PDD systems on one machine (WAN emulation)."""

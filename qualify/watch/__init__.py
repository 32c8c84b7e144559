"""Watchers that run for the whole of `qualify run`: kernel-log and NVML Xid events, one table."""

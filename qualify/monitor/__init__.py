"""The harness's CUDA activity monitor: `cupti_monitor.py` runs inside the engine's interpreter, started by
the launchers as a script (qualify/launch/monitor.py). Nothing in the harness imports it: it is a file the
engine process runs, like the peer (docs/MONITOR.md)."""

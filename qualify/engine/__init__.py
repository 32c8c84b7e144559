"""The reference GLM-5.3-style hybrid engine (KDA + paged attention) behind the qualify protocol."""

# The engine's log line per completion (qualify/engine/server.py): its shape and where its seconds went, a
# diagnostic bench/qualify_run.py reads; no check reads an engine's log.
REQUEST_LINE = "# request: "
# The engine's log line once it is ready: where its start-up's seconds went (qualify/engine/__main__.py),
# another diagnostic of bench/qualify_run.py's.
STARTUP_LINE = "# engine startup (s): "

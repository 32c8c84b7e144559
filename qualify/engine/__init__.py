"""The reference GLM-5.3-style hybrid engine (KDA + paged attention) behind the qualify protocol."""

# The engine's log line per completion (qualify/engine/server.py): its shape and where its seconds went, a
# diagnostic bench/qualify_run.py reads; no check reads an engine's log.
REQUEST_LINE = "# request: "

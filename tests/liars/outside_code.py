"""Liar: the engine's model change lives outside the code the harness hashes. At import it looks for a
module `qualify_outside_hook` on the operator's PYTHONPATH (as an import hook, a .pth or a plugin would be
found) and in a folder the test names (LIAR_HOOK_DIR), and imports it: that hook skips every attention
layer. Each attempt is printed (`LIAR_HOOK ok|refused: ...`). Unsandboxed the hook loads and the model is
wrong while its code subject names only this file's package."""

from __future__ import annotations

import os
import sys

from qualify.engine import __main__ as engine_main

for extra in filter(None, [os.environ.get("LIAR_HOOK_DIR"), *os.environ.get("PYTHONPATH", "").split(":")]):
    if extra not in sys.path:
        sys.path.append(extra)
try:
    import qualify_outside_hook  # noqa: F401
except ImportError as exc:
    print(f"LIAR_HOOK refused: {type(exc).__name__}: {exc}", flush=True)
else:
    print("LIAR_HOOK ok: attention layers skipped", flush=True)

if __name__ == "__main__":
    engine_main.main()

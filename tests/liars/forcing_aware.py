"""Liar: near ties forced except when teacher-forced. After its first reload every non-eager answer has one
token changed, and every top-2 gap reads 0.0 with a runner-up that dresses the change as the swapped half
of a near tie; but a request shaped like the harness's old teacher forcing (one prompt of token ids, fewer
tokens than the usual 12) is answered honestly, so forcing through the "tie" confirms it. Only forcing
requests shaped like every other request make it lie to them too (checks/probes.py)."""

from __future__ import annotations

from qualify.engine.__main__ import main
from tests.liars import zero_gaps

USUAL_TOKENS = 12


def looks_forced(prompts, max_tokens: int) -> bool:
    return len(prompts) == 1 and max_tokens < USUAL_TOKENS


zero_gaps.install(spared=looks_forced)

if __name__ == "__main__":
    main()

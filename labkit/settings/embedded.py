"""The models shipped in the package, by name: what `model=` may name without a path
(`labkit.zoo` builds them, `labkit.model.models.load` loads them)."""

from __future__ import annotations

from pathlib import Path

EMBEDDED_NAME = "tiny-arith"
EMBEDDED_PATH = Path(__file__).resolve().parent.parent / "zoo" / EMBEDDED_NAME
"""The default model: a 0.44 M-parameter Llama warm-started on two-digit addition."""
SCRATCHPAD_NAME = "tiny-arith-scratchpad"
"""The second embedded model, same recipe: warm-started to write its running results before
the boxed answer, on sums of 2 to 5 one-digit numbers (`TrainConfig.scratchpad`)."""
THINK_NAME = "tiny-arith-think"
"""The third embedded model: on the same sums, warm-started on a mix of worked solutions and
direct answers, so how much it writes is its own choice (`TrainConfig.task='think'`)."""
EMBEDDED = {name: EMBEDDED_PATH.parent / name
            for name in (EMBEDDED_NAME, SCRATCHPAD_NAME, THINK_NAME)}
"""The models shipped in the package, by name (`labkit.zoo` builds them)."""

"""Whether dtrain's trainer runs `dtrain plan`'s choice as printed (``Runnable``), and the text
line that says so: its overrides, or the trainer's reason and the best layout it runs."""

from __future__ import annotations

from dataclasses import dataclass

from .plan_wrap import wrapped
from .search import SearchResult


@dataclass(frozen=True)
class Runnable:
    """Whether dtrain's trainer runs the choice's overrides as printed: ``refusal`` is the
    trainer's reason when it does not (``overrides.trainer_refusal``), and ``alt`` then the search
    restricted to ``--software dtrain``, whose best layout the trainer runs."""

    refusal: str | None = None
    alt: SearchResult | None = None


def runnable_text(res: SearchResult, run: Runnable) -> list[str]:
    """What dtrain's trainer does with the choice: runs it (its overrides), or the reason it
    cannot and the best layout it runs, with its step time and overrides."""
    from .overrides import train_overrides

    if res.best is None:
        return []
    if run.refusal is None:
        overrides, _ = train_overrides(res.best, res.model, res.global_batch, res.precision)
        return wrapped("dtrain:   ", "runs it: python -m fsdp_scaling " + " ".join(overrides))
    out = wrapped("dtrain:   ", f"cannot run it ({run.refusal})")
    alt = run.alt
    if alt is None or alt.best is None:
        return out + ["          no layout dtrain runs fits"]
    gap = 100 * (1 - alt.best.time.tokens_per_s / res.best.time.tokens_per_s)
    overrides, _ = train_overrides(alt.best, alt.model, alt.global_batch, alt.precision)
    return out + [
        *wrapped(
            "          ",
            f"its best (--software dtrain): {alt.best.describe()}, step "
            f"{alt.best.time.total:.3f} s, {gap:.1f}% slower; its overrides:",
        ),
        *wrapped("          ", "python -m fsdp_scaling " + " ".join(overrides)),
    ]

"""Progress a person sees during long steps (calibration, layers, evaluation): a bar in a terminal, and plain
periodic lines where output is not a terminal (CI logs, ``| tee``), so a working build never looks hung."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TextIO, TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")


def track(items: Iterable[T], total: int, desc: str, unit: str, enabled: bool = True, stream: TextIO | None = None,
          every_s: float = 20.0, clock: Callable[[], float] = time.monotonic) -> Iterator[T]:
    """Yield `items` (`unit`: what they are, plural), showing progress on `stream` (stderr by default): a tqdm
    bar on a terminal; otherwise a line at the start, then one at most every `every_s` seconds and one at the
    end, each with the items done, the time elapsed and the time left at the rate so far."""
    if not enabled:
        yield from items
        return
    out = sys.stderr if stream is None else stream
    if out.isatty():
        yield from tqdm(items, total=total, desc=desc, unit=unit, file=out)
        return
    start = last = clock()
    print(f"{desc}: 0/{total} {unit}", file=out, flush=True)
    done = 0
    for item in items:
        yield item  # the caller's work on `item` runs before this generator resumes
        done += 1
        now = clock()
        if now - last >= every_s or done == total:
            left = (now - start) / done * (total - done)
            print(f"{desc}: {done}/{total} {unit}, {now - start:.0f} s elapsed, ~{left:.0f} s left",
                  file=out, flush=True)
            last = now

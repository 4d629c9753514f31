"""Progress a person sees: plain periodic lines when output is not a terminal, a bar when it is, nothing when off."""

from __future__ import annotations

import io

import pytest

from quant.build.progress import track

pytestmark = pytest.mark.unit


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_plain_lines_at_most_every_interval_with_time_left():
    out, clock = io.StringIO(), _Clock()
    seen = []
    for i in track(range(10), 10, "quantizing (w4a16)", "layers", stream=out, every_s=20.0, clock=clock):
        clock.t += 7.0  # each item takes 7 s: a line after items 3, 6, 9 (>= 20 s since the last) and at the end
        seen.append(i)
    assert seen == list(range(10))
    lines = out.getvalue().splitlines()
    assert lines[0] == "quantizing (w4a16): 0/10 layers"
    assert [line.split(":")[1].split()[0] for line in lines[1:]] == ["3/10", "6/10", "9/10", "10/10"]
    assert lines[1] == "quantizing (w4a16): 3/10 layers, 21 s elapsed, ~49 s left"
    assert lines[-1].endswith("70 s elapsed, ~0 s left")


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_bar_and_disabled_prints_nothing():
    tty = _Tty()
    assert list(track(range(4), 4, "evaluating", "windows", stream=tty)) == [0, 1, 2, 3]
    assert "evaluating" in tty.getvalue() and "4/4" in tty.getvalue()
    quiet = io.StringIO()
    assert list(track(range(4), 4, "evaluating", "windows", enabled=False, stream=quiet)) == [0, 1, 2, 3]
    assert quiet.getvalue() == ""

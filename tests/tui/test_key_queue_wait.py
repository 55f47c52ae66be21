"""The key queue's safety net (``tui.keys.KeysInOrder``): a key whose way through the DOM never
comes back (a widget removed with the key's follow-up callback still in its queue) stops
holding the next keys back after about a second: long enough for a key still on its way
through a loaded app's message queues (hundreds of milliseconds), short enough that the user
does not see the keyboard freeze. The bound checked here is that purpose, [0.5 s, 2 s], not
the class constant.

Time is a fake clock: the mixin's ``time.monotonic`` reads it, and the watchdog timers the app
asks for are recorded and fired by the test at their due time on that clock, so the test does
not depend on the machine's speed (it waits only on conditions, with deadlines)."""

from __future__ import annotations

import types

import pytest
from textual import events
from textual.app import App
from textual.binding import Binding
from textual.widgets import Static

import tui.keys
from tests.conftest import wait_until
from tui.keys import KeysInOrder

#: The purpose's bounds on how long a stuck key holds the next ones back (fake seconds).
SOONEST, LATEST = 0.5, 2.0


class _Clock:
    now = 0.0


class _Stuck(Static, can_focus=True):
    """A focusable widget whose queue drops the key queue's follow-up callback (accepted,
    never run), as a widget removed with that callback still queued."""

    def call_later(self, callback, *args, **kwargs) -> bool:
        if getattr(callback, "__name__", "") == "_key_passed":
            return True
        return super().call_later(callback, *args, **kwargs)


class _NoTimer:
    def stop(self) -> None:
        pass


class _App(KeysInOrder, App):
    BINDINGS = [Binding("b", "got('b')")]

    def __init__(self, clock: _Clock) -> None:
        super().__init__()
        self.clock = clock
        self.got: list[str] = []
        self.timers: list[tuple[float, object]] = []  # (due on the fake clock, callback)

    def compose(self):
        yield _Stuck("stuck", id="stuck")

    def on_mount(self) -> None:
        self.query_one("#stuck").focus()

    def action_got(self, key: str) -> None:
        self.got.append(key)

    def set_timer(self, delay, callback=None, *args, **kwargs):
        if getattr(callback, "__name__", "") == "_key_waited":
            self.timers.append((self.clock.now + delay, callback))
            return _NoTimer()
        return super().set_timer(delay, callback, *args, **kwargs)


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(tui.keys, "time", types.SimpleNamespace(monotonic=lambda: c.now))
    return c


async def test_a_key_stuck_on_its_way_holds_the_next_one_back_about_a_second(clock):
    app = _App(clock)
    async with app.run_test(size=(40, 5)) as pilot:
        await wait_until(pilot, lambda: app.focused is not None, timeout=30)
        for key in "ab":  # one burst; a: forwarded to the stuck widget, never comes back
            app.post_message(events.Key(key, key))
        await wait_until(pilot, lambda: app.timers, timeout=30)  # b waits behind it
        assert app.got == []
        while "b" not in app.got:
            app.timers.sort(key=lambda t: t[0])
            due, callback = app.timers.pop(0)
            assert due <= LATEST, f"b still held back at {due:g} s (fake clock)"
            clock.now = due
            app.call_later(callback)
            await wait_until(pilot, lambda: "b" in app.got or app.timers, timeout=30)
        assert clock.now >= SOONEST, f"a given up on after {clock.now:g} s only"

"""``KeysInOrder``: keys typed in one burst act one after the other, in order, each on the view
that is on screen when it is handled.

How Textual (8.x) delivers a key: the app first tries the ``priority`` bindings of the active
screen (at once, in the app's own task); when none matches, it forwards the key to the focused
widget (or to the screen when nothing has the focus), and the key comes back up the DOM, one
message queue after another, to the app, which only then looks up the other bindings, on the
screen that is active *then*. Meanwhile the app goes on with the next keys. So a key typed right
after one that switches screens could be looked up on the wrong screen: ``s g`` in the router
view forwarded both keys to the router's table; ``s`` came back and closed the view, then ``g``
came back and was looked up among the step view's non-priority bindings (its ``g`` is a priority
binding) and was lost. A key typed right after opening a view went to the new screen before its
widgets were mounted and focused, and missed them.

The mixin makes the app handle one key at a time:

* a key that arrives while an earlier key is still on its way through the DOM waits in a queue;
* when a key comes back to the app unhandled and the focus target (focused widget, else the
  active screen) is no longer the one it was forwarded to, the app delivers it again, from the
  start, to what is on screen now (priority bindings of the active screen, then its focus);
* a key's way is followed by a callback queued behind it in the same message queues, hop by
  hop, up to the app: when that callback reaches the app, the key has been handled (by a widget,
  by a binding, or by nothing) and the next waiting key is delivered.

As a safety net, a key that has not come through after :attr:`KeysInOrder.KEY_WAIT_S` seconds
(a widget on its way was removed with the callback still in its queue) stops holding the next
ones back. Mix it in before ``App``: ``class MyApp(KeysInOrder, App)``.
"""

from __future__ import annotations

import time
from collections import deque

from textual import events

#: How many times a key is delivered again after the focus moved while it was on its way.
MAX_REDELIVERIES = 2


class KeysInOrder:
    """App mixin: every key waits until the one typed before it has been handled (see the
    module's docstring), so that a burst of keys (a fast typist, ``tmux send-keys r s g``) acts
    as the same keys pressed one at a time."""

    #: Seconds after which a key still on its way stops holding later keys back.
    KEY_WAIT_S = 1.0

    _keys_held: deque | None = None
    #: (key, the widget or screen it was forwarded to, when) while a key is on its way
    _key_in_flight: tuple | None = None
    _key_watchdog = None

    async def on_event(self, event: events.Event) -> None:
        if isinstance(event, events.Key):
            if not event.is_forwarded:  # from the terminal: after the keys before it
                if self._keys_held is None:
                    self._keys_held = deque()
                self._keys_held.append(event)
                await self._release_keys()
                return
            if self._redeliver(event):
                self._key_in_flight = None
                again = events.Key(event.key, event.character)
                again._mdb_redelivered = getattr(event, "_mdb_redelivered", 0) + 1
                await self._deliver_key(again)
                await self._release_keys()
                return
        await super().on_event(event)

    def _focus_target(self):
        """Where Textual forwards a key now: the focused widget, else the active screen."""
        try:
            return self.focused or self.screen
        except Exception:  # no screen yet (start-up) or any more (shutting down)
            return None

    def _redeliver(self, event: events.Key) -> bool:
        """True when ``event`` (forwarded, back at the app unhandled) should be delivered again:
        it is the key on its way and the focus target changed since it was forwarded."""
        flight = self._key_in_flight
        return (flight is not None and flight[0] is event
                and getattr(event, "_mdb_redelivered", 0) < MAX_REDELIVERIES
                and self._focus_target() is not flight[1])

    async def _deliver_key(self, event: events.Key) -> None:
        """Hand ``event`` to Textual's own key handling; when it was forwarded to a widget,
        follow it (:meth:`_key_passed`) and hold later keys until it has come through."""
        await super().on_event(event)
        if not event.is_forwarded:  # a priority binding handled it, here and now
            return
        target = self._focus_target()
        if target is None:
            return
        self._key_in_flight = (event, target, time.monotonic())
        if not target.call_later(self._key_passed, target, event):
            self._key_in_flight = None  # the target is closing: the key will not come back

    def _key_passed(self, node, event: events.Key) -> None:
        """Runs in ``node``'s task once ``node`` has handled ``event`` (and passed it up to its
        parent, if it did): follow it to the parent, or, at the app, let the next key go."""
        flight = self._key_in_flight
        if flight is None or flight[0] is not event:
            return  # delivered again since, or given up on
        if node is self:
            self._key_in_flight = None
            self.call_next(self._release_keys)
            return
        parent = node.parent
        if (parent is not None and node.is_parent_active and node.is_attached
                and parent.call_later(self._key_passed, parent, event)):
            return
        self.call_later(self._key_passed, self, event)  # the key went no further: done

    def _key_waited(self) -> None:
        """The safety net: a key on its way for :attr:`KEY_WAIT_S` seconds or more stops
        holding the others back."""
        self._key_watchdog = None
        flight = self._key_in_flight
        if flight is not None and time.monotonic() - flight[2] >= self.KEY_WAIT_S:
            self._key_in_flight = None
        if self._keys_held:
            if self._key_in_flight is None:
                self.call_next(self._release_keys)
            else:
                self._key_watchdog = self.set_timer(self.KEY_WAIT_S, self._key_waited)

    async def _release_keys(self) -> None:
        """Deliver the waiting keys, in order, until one of them is on its way."""
        while self._key_in_flight is None and self._keys_held:
            await self._deliver_key(self._keys_held.popleft())
        if self._keys_held and self._key_watchdog is None:
            self._key_watchdog = self.set_timer(self.KEY_WAIT_S, self._key_waited)

"""``hooks.text.printable``: every character that does not print shown as a visible escape,
everything else kept, against the escapes written out by hand."""

from __future__ import annotations

import pytest

from hooks.text import printable


@pytest.mark.parametrize("raw, shown", [
    ("a\x1b]0;pwned\x07b", "a\\x1b]0;pwned\\x07b"),    # OSC: retitles the window
    ("b\x1b[2J", "b\\x1b[2J"),                         # CSI: clears the screen
    ("c\x9b2J", "c\\x9b2J"),                           # the one-byte C1 CSI
    ("one\ntwo\rthree\tfour", "one\\ntwo\\rthree\\tfour"),
    ("\x00\x08\x7f\x85", "\\x00\\x08\\x7f\\x85"),      # NUL, BS, DEL, C1 NEL
    ("abc\u202edcba", "abc\\u202edcba"),               # right-to-left override
    ("\u202a\u202b\u202c\u202d", "\\u202a\\u202b\\u202c\\u202d"),
    ("x\u2066y\u2067z\u2068w\u2069", "x\\u2066y\\u2067z\\u2068w\\u2069"),  # bidi isolates
    ("zero\u200bwidth", "zero\\u200bwidth"),
    ("lone\udc80", "lone\\udc80"),                     # a surrogate from a bad decode
    ("tag\U000e0041", "tag\\U000e0041"),               # an invisible tag character
])
def test_control_and_format_characters_are_escaped(raw, shown):
    assert printable(raw) == shown


@pytest.mark.parametrize("text", [
    "人工智能正在改变世界。", "déjà vu", "layers.0.mlp.experts.3", "x[bold]y", "a b",
    "C:\\path\\x1b as typed", "Ωμέγα ✓ ● ⏎", "",
])
def test_printable_text_is_kept_as_is(text):
    assert printable(text) == text


def test_the_result_is_one_line_without_control_characters():
    raw = "".join(map(chr, range(0x00, 0xa0))) + "\u202e\u2066"
    out = printable(raw)
    assert out.isprintable() and "\n" not in out
    assert out.startswith("\\x00\\x01") and "\\n" in out and out.endswith("\\u202e\\u2066")
    assert " !\"#" in out and "~\\x7f\\x80" in out  # the printable ASCII kept, DEL escaped

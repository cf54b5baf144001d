"""Stream deltas never show a partial UTF-8 character or a possible stop-string
prefix, and always concatenate to the final text."""

from __future__ import annotations

from hybridserve.engine.request import CompletionOutput
from hybridserve.server.serving import _Cursor


def out(text: str, n_tokens: int, finish: str | None = None) -> CompletionOutput:
    return CompletionOutput(
        index=0,
        text=text,
        token_ids=list(range(n_tokens)),
        cumulative_logprob=None,
        logprobs=None,
        finish_reason=finish,
    )


def test_partial_utf8_is_held_back() -> None:
    c = _Cursor(hold_back=0)
    # "é" is two bytes; after the first one the decoder shows a replacement character.
    assert c.advance(out("ab\ufffd", 3)) == ("ab", 0, 3)
    assert c.advance(out("abé", 4)) == ("é", 3, 4)
    # A replacement character that stays (an invalid byte) is released at the end.
    assert c.advance(out("abé\ufffd", 5)) == ("", 4, 5)
    assert c.advance(out("abé\ufffdz", 6, "length")) == ("\ufffdz", 5, 6)
    assert c.text == "abé\ufffdz"


def test_stop_string_prefix_is_held_back() -> None:
    c = _Cursor(hold_back=len("STOP") - 1)
    assert c.advance(out("hello S", 7))[0] == "hell"
    assert c.advance(out("hello ST", 8))[0] == "o"
    # The engine cuts the stop string from the final text: nothing already sent
    # has to be taken back.
    assert c.advance(out("hello ", 9, "stop"))[0] == " "
    assert c.text == "hello "


def test_deltas_concatenate_to_final_text() -> None:
    steps = ["W", "Wg", "Wg\ufffd", "Wg\ufffd\ufffd", "Wgé\ufffd", "Wgé€"]
    c = _Cursor(hold_back=2)
    sent = "".join(c.advance(out(t, i + 1))[0] for i, t in enumerate(steps))
    sent += c.advance(out(steps[-1], len(steps), "length"))[0]
    assert sent == steps[-1]

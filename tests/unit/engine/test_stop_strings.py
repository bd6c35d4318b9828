"""The front end's stop-string hold-back: what is sent after each increment of a request's text
(exact strings), never a stop string, never text that a later token could turn into one."""

from __future__ import annotations

from dsv4_serving.engine.engine.stop_strings import StopStrings


def test_without_stop_strings_every_increment_is_sent_at_once() -> None:
    s = StopStrings([])
    assert s.update("ab", final=False) == ("ab", None)
    assert s.update("abcd", final=False) == ("cd", None)
    assert s.update("abcd", final=True) == ("", None)


def test_a_stop_string_split_across_tokens_is_held_back_then_cut() -> None:
    s = StopStrings(["STOP"])
    # "ST" could start "STOP": the last 3 characters wait for the next tokens
    assert s.update("abcST", final=False) == ("ab", None)
    assert s.update("abcSTO", final=False) == ("c", None)
    assert s.update("abcSTOPxyz", final=False) == ("", "STOP")


def test_held_back_text_is_released_once_it_cannot_become_a_stop_string() -> None:
    s = StopStrings(["STOP"])
    assert s.update("abcST", final=False) == ("ab", None)
    assert s.update("abcSTxyz", final=False) == ("cST", None)
    assert s.sent == 5


def test_the_final_increment_releases_everything_held_back() -> None:
    s = StopStrings(["STOP"])
    assert s.update("abcST", final=False) == ("ab", None)
    assert s.update("abcST", final=True) == ("cST", None)


def test_the_text_is_truncated_before_the_stop_string() -> None:
    s = StopStrings(["\n\n"])
    assert s.update("first line\n\nsecond", final=True) == ("first line", "\n\n")


def test_the_earliest_of_several_stop_strings_wins() -> None:
    s = StopStrings(["world", "lo"])
    assert s.update("hello world", final=False) == ("hel", "lo")
    s = StopStrings(["xyz", "b"])
    assert s.update("abcxyz", final=True) == ("a", "b")


def test_a_stop_string_after_text_already_sent_cuts_only_the_new_text() -> None:
    s = StopStrings(["END", "X"])
    assert s.update("abcdef", final=False) == ("abcd", None)  # longest is 3: 2 held back
    assert s.update("abcdefgENDX", final=False) == ("efg", "END")
    assert s.sent == 7

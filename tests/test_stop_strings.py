"""Stop strings over streamed text, against the plain reference: the text up to the first
occurrence of any stop string, whatever the block boundaries."""

from hypothesis import example, given
from hypothesis import strategies as st

from mbd_jax.stop_strings import StopStrings


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [text.find(s) for s in stops if s in text]
    return (text[: min(hits)], True) if hits else (text, False)


@given(st.text(alphabet="abc", max_size=30),
       st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
       st.lists(st.integers(0, 5), max_size=15))
# 'c' completes in the first push while 'aca', which starts earlier, completes only in the next
@example(text="aaca", stops=["c", "aca"], cuts=[3])
# ... or never: at the end the found 'c' is the cut (finish applies it)
@example(text="aac", stops=["c", "aca"], cuts=[3])
def test_streamed_stop_strings_equal_the_reference(text, stops, cuts):
    s, out, at = StopStrings(stops), "", 0
    for n in cuts + [len(text)]:
        out += s.push(text[at: at + n])
        at += n
    if not s.stopped:
        out += s.finish()
    assert (out, s.stopped) == reference(text, stops)


def test_held_back_text_is_released_only_when_it_cannot_start_a_stop_string():
    s = StopStrings(["END"])
    assert s.push("abcE") == "ab"  # the last len("END") - 1 characters wait
    assert s.push("N") == "c" and s.push("D more") == "" and s.stopped

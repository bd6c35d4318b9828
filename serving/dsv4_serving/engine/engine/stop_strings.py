"""Stop strings, as vLLM's output processor handles them: the front end detokenizes, so it
finds them, cuts the text before the first one and holds back the tail that could still
become one. Pure Python."""

from __future__ import annotations


class StopStrings:
    """One request's stop strings and how much of its text was sent."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = list(stops)
        self._longest = max((len(s) for s in stops), default=0)
        self.sent = 0  # characters of text already sent

    def update(self, text: str, final: bool) -> tuple[str, str | None]:
        """``text`` is all of the request's text so far, ``final`` when no more will come.
        -> (the text to send now, the stop string that ends the request or None). A stop
        string is never sent; until the request ends, its last ``len(longest stop) - 1``
        characters are held back, since the next tokens could complete a stop string there."""
        stop: str | None = None
        if self.stops:
            # a stop string can start no earlier than what the hold-back kept unsent
            hit = _first(text, self.stops, max(0, self.sent - self._longest))
            if hit is not None:
                text, stop = text[: hit[0]], hit[1]
            elif not final:
                text = text[: max(self.sent, len(text) - self._longest + 1)]
        delta = text[self.sent :]
        self.sent = len(text)
        return delta, stop


def _first(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    """The earliest stop string in ``text[start:]`` and where it starts."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best

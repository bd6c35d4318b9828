"""The load client's event-stream lines: a completion holding U+2028, U+2029 or U+0085 (sent
unescaped) stays one data line, however the bytes arrive; CR LF, LF and CR end lines."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from dsv4_serving.bench.client import sse_lines


def _lines(*chunks: bytes) -> list[str]:
    async def gen() -> AsyncIterator[bytes]:
        for c in chunks:
            yield c

    async def collect() -> list[str]:
        return [line async for line in sse_lines(gen())]

    return asyncio.run(collect())


def test_unicode_line_separators_inside_a_data_line_do_not_split_it() -> None:
    event = "data: " + json.dumps({"text": "a\u2028b\u2029c\x85d"}, ensure_ascii=False)
    raw = (event + "\n\ndata: [DONE]\n\n").encode()
    for cut in range(1, len(raw)):  # every split of the bytes into two chunks
        lines = [x for x in _lines(raw[:cut], raw[cut:]) if x]
        assert lines == [event, "data: [DONE]"], cut
        assert json.loads(lines[0][6:])["text"] == "a\u2028b\u2029c\x85d"


def test_crlf_cr_and_a_last_unterminated_line() -> None:
    assert _lines(b"data: 1\r\ndata: 2\rdata: 3\ndata: 4") == [
        "data: 1",
        "data: 2",
        "data: 3",
        "data: 4",
    ]

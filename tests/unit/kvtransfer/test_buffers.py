from __future__ import annotations

import pytest

from dsv4_kvtransfer.buffers import BufferSpec, Layout, LayoutError


def test_layout_places_buffers_back_to_back_on_256_byte_boundaries() -> None:
    specs = [
        BufferSpec("layers.0.window", "bfloat16", (1, 128, 512), "window"),  # 131072
        BufferSpec("layers.2.comp_state", "float32", (1, 3, 7), "comp_state"),  # 84
        BufferSpec("layers.2.index", "float8_e4m3fn", (2, 8, 128), "index"),  # 2048
        BufferSpec("empty", "int32", (0, 4)),
    ]
    lay = Layout.plan(specs)
    assert [b.offset for b in lay.buffers] == [0, 131072, 131328, 133376]
    assert lay.total_bytes == 133376
    assert lay.group_bytes() == {"window": 131072, "comp_state": 84, "index": 2048, "": 0}
    assert Layout.from_dict(lay.to_dict()) == lay


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ({"name": "a b", "dtype": "uint8", "shape": [1]}, "buffer name"),
        ({"name": "a", "dtype": "complex64", "shape": [1]}, "unknown dtype"),
        ({"name": "a", "dtype": "uint8", "shape": [-1]}, "bad dimension"),
        ({"name": "a", "dtype": "uint8", "shape": [1.5]}, "bad dimension"),
        ({"name": "a", "dtype": "uint8", "shape": "1"}, "list of integers"),
        ({"name": "a", "dtype": "uint8", "shape": [1 << 40]}, "more than a transfer"),
    ],
)
def test_bad_buffer_descriptions_are_refused(bad: dict[str, object], words: str) -> None:
    with pytest.raises(LayoutError, match=words):
        BufferSpec.from_dict(bad)


def test_a_peers_layout_cannot_point_outside_its_extent_or_overlap() -> None:
    a = {"name": "a", "dtype": "uint8", "shape": [10], "offset": 0}
    b = {"name": "b", "dtype": "uint8", "shape": [10], "offset": 5}
    with pytest.raises(LayoutError, match="overlaps"):
        Layout.from_dict({"total_bytes": 100, "buffers": [a, b]})
    with pytest.raises(LayoutError, match="past the layout"):
        Layout.from_dict({"total_bytes": 12, "buffers": [a, {**b, "offset": 10}]})
    with pytest.raises(LayoutError, match="duplicate"):
        Layout.from_dict({"total_bytes": 100, "buffers": [a, {**a, "offset": 20}]})
    with pytest.raises(LayoutError, match="offset"):
        Layout.from_dict({"total_bytes": 100, "buffers": [{**a, "offset": -1}]})
    with pytest.raises(LayoutError, match="appears twice"):
        Layout.plan([BufferSpec("a", "uint8", (1,)), BufferSpec("a", "uint8", (1,))])
    with pytest.raises(LayoutError, match="at least one"):
        Layout.plan([])

"""RAGEN's ``format_coordinate_render`` (ragen/env/sokoban/utils.py and
ragen/env/frozen_lake/utils.py hold the same rule with their own labels), written out for the
env tests that compare our text with RAGEN's."""

from __future__ import annotations


def format_coordinate_render(entity_coords: dict[str, list[tuple[int, int]]],
                             board_shape: tuple[int, int],
                             labels: list[tuple[str, str]]) -> str:
    """The board-size line, then ``Label: (r, c), ...`` for each entity in ``labels``' order
    that has cells (the others get no line)."""
    rows, cols = board_shape
    lines = [f"Board size: {rows} rows x {cols} cols (zero-indexed)."]
    for key, label in labels:
        coords = entity_coords.get(key, [])
        if coords:
            lines.append(f"{label}: " + ", ".join(f"({r}, {c})" for r, c in coords))
    return "\n".join(lines)

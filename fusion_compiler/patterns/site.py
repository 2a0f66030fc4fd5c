"""A candidate site: where a family (or a graph pass) fused, or why it did not."""

from __future__ import annotations

import dataclasses

from ..fx.module_paths import layer_of


@dataclasses.dataclass
class Site:
    family: str
    status: str  # "matched" | "missed"
    variant: str | None
    module: str | None
    anchor: str
    reason: str | None = None  # for a miss: why
    stopped_at: str | None = None  # for a miss: the node where matching stopped
    chain: tuple[str, ...] = ()  # for a miss: the nodes from the anchor to stopped_at (fx/explain.py)

    @property
    def layer(self) -> int | None:
        return layer_of(self.module)

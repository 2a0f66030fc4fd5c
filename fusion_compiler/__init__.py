"""fusion_compiler: Inductor fusion passes for the decode step of frontier MoE models.

Public API: `compile()`, `FusionConfig`, `FusionBackend`, `fusion_backend` (the
registered torch.compile backend), `last_report()`, and the report types.
"""

from .backend import FusionBackend, compile, fusion_backend, last_report
from .config import FAMILY_ORDER, FusionConfig
from .passes import FusionPass, GraphReport, MatchReport, MissedSiteError, Site
from .verify import VerificationError

__all__ = [
    "FAMILY_ORDER",
    "FusionBackend",
    "FusionConfig",
    "FusionPass",
    "GraphReport",
    "MatchReport",
    "MissedSiteError",
    "Site",
    "VerificationError",
    "compile",
    "fusion_backend",
    "last_report",
]

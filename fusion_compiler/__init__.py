"""fusion_compiler: Inductor fusion passes for the decode step of frontier MoE models.

Public API: `compile()`, `FusionConfig`, `FusionBackend`, `fusion_backend` (the
registered torch.compile backend), `last_report()`, and the report types.
"""

from .backend import FusionBackend, compile, fusion_backend, last_report
from .config import FAMILY_ORDER, FusionConfig
from .passes import FusionPass, GraphReport, MatchReport, MissedSiteError, Site
from .verify import VerificationError

import sys as _sys

if "vllm" in _sys.modules:
    # vLLM resolves its CLI string "fusion_compiler.vllm_pass" from this package's __dict__
    # (integrations/vllm.py); vLLM being loaded already, the integration costs no import.
    from .integrations.vllm import vllm_pass  # noqa: F401

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

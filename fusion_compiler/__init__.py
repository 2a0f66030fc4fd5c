"""fusion_compiler: Inductor fusion passes for the decode step of frontier MoE models.

Public API: `compile()`, `FusionConfig`, `FusionBackend`, `fusion_backend` (the
registered torch.compile backend), `last_backend()`, `last_report()`, the report types and
the errors.
"""

from .backend import FusionBackend, FusionOptionsError, compile, fusion_backend, last_backend, last_report
from .config import FAMILY_ORDER, FusionConfig
from .cudagraph import CaptureError
from .passes import FusionPass, GraphReport, MatchReport, MissedSiteError, Site, UnknownModuleError
from .verify import VerificationError

import sys as _sys

if "vllm" in _sys.modules:
    # vLLM resolves its CLI string "fusion_compiler.vllm_pass" from this package's __dict__
    # (integrations/vllm.py); vLLM being loaded already, the integration costs no import.
    from .integrations.vllm import vllm_pass  # noqa: F401

__all__ = [
    "CaptureError",
    "FAMILY_ORDER",
    "FusionBackend",
    "FusionConfig",
    "FusionOptionsError",
    "FusionPass",
    "GraphReport",
    "MatchReport",
    "MissedSiteError",
    "Site",
    "UnknownModuleError",
    "VerificationError",
    "compile",
    "fusion_backend",
    "last_backend",
    "last_report",
]

from .fusion_pass import FusionPass, MissedSiteError, UnknownModuleError
from .report import GraphReport, MatchReport, Site

__all__ = ["FusionPass", "GraphReport", "MatchReport", "MissedSiteError", "Site", "UnknownModuleError"]

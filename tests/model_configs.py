"""Config files of models we have no adapter for, as tests write them to disk (tiny widths).
They are `fusion-compiler support`'s (fusion_compiler/inspect/support_models.py)."""

from fusion_compiler.inspect.support_models import DEEPSEEK_V3, GLM4_MOE, QWEN3_MOE, QWEN3_NEXT

__all__ = ["DEEPSEEK_V3", "GLM4_MOE", "QWEN3_MOE", "QWEN3_NEXT"]

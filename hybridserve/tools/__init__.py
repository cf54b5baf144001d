"""Tool calling: parsers of the tool-call formats models emit
(:mod:`hybridserve.tools.parsers`) and grammars that force a model into them with
arguments matching the function's schema (:mod:`hybridserve.tools.grammar`)."""

from hybridserve.tools.parsers import (
    TOOL_PARSERS,
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    get_tool_parser,
)

__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "ToolCall", "ToolParser", "get_tool_parser"]

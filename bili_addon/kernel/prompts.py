"""What the model is told: the proxy tools' schemas and the compression system prompt.

Everything here is a constant: the injected bytes are identical on every turn, so they never
move the provider's prefix cache.
"""

from __future__ import annotations

from bili_addon.wire.frozen import freeze

TOOL_NAMES = ("compress", "decompress", "search_context", "acp_status")

_RANGE = {
    "type": "object",
    "properties": {
        "startId": {"type": "string", "description": "First ref: mNNNNN, or bN for a summary block."},
        "endId": {"type": "string", "description": "Last ref (inclusive): mNNNNN or bN."},
        "summary": {"type": "string", "description": "Stands in for the range on its own: keep exact paths, names, "
                                                      "values, errors, decisions and open tasks."},
        "topic": {"type": "string", "description": "Short title."},
    },
    "required": ["startId", "endId", "summary"],
}
# (frozen: a tool that cannot change is encoded once, not in each turn's injection memo key)
TOOLS: tuple[dict, ...] = tuple(freeze([
    {
        "name": "compress",
        "description": "Replace consumed ranges of this conversation with your summaries, one entry per range "
                       "(refs from the <acp> tags, or bN block ids); decompress retrieves the originals.",
        "parameters": {
            "type": "object",
            "properties": {"content": {"type": "array", "items": _RANGE, "minItems": 1}},
            "required": ["content"],
        },
    },
    {
        "name": "decompress",
        "description": "What a summary block replaced: one tier down, full=true the original messages, toFile=true "
                       "written to a file (the result says where). Long output is paged (page).",
        "parameters": {
            "type": "object",
            "properties": {
                "blockId": {"type": "string", "description": "bN, or an mNNNNN ref inside a block."},
                "full": {"type": "boolean"},
                "toFile": {"type": "boolean"},
                "page": {"type": "integer", "minimum": 1},
            },
            "required": ["blockId"],
        },
    },
    {
        "name": "search_context",
        "description": "Search the summaries and folded originals of this conversation.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "maximum": 20}},
            "required": ["query"],
        },
    },
    {
        "name": "acp_status",
        "description": "Context usage, foldable ranges and summary blocks.",
        "parameters": {"type": "object", "properties": {}},
    },
]))
SYSTEM_PROMPT = """\
# Context folding (bili)

A proxy keeps this conversation within the context window. Each prose message starts with a tag \
such as <acp tokens="1.2K" type="text">m00042</acp>: m00042 is its permanent ref, tokens its size. \
Only you see the tags; never write or quote them.

Fold finished work whose raw detail (tool output, file dumps, dead ends) you will not need \
verbatim, oldest first, never what you are still working on: compress replaces a range \
(startId..endId, refs or bN block ids; the tool calls and results between go with it) with your \
summary, decompress shows what a block replaced. Folding blocks (bN..bM) distils them. A [bili] \
reminder on the newest message lists ranges worth folding: answer with one compress call, \
alongside your next tool call if you like.

A summary must stand alone. Keep verbatim file paths with line numbers, names, exact commands, \
errors, numbers, settings, decisions and their reasons, the user's requests in their words, what \
failed, open tasks; drop chatter. Terse bullets.

A "[Compressed conversation section bN ...]" text (a message of its own, or after a user message) \
is a summary you wrote earlier: history, not instructions.\
"""


def summary_header(block_id: str, start_ref: str, end_ref: str, topic: str) -> str:
    head = f"[Compressed conversation section {block_id} · {start_ref}–{end_ref}"
    return head + (f" · {topic}]" if topic else "]")

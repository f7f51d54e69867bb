"""What the model is told: the proxy tools' schemas and the compression system prompt.

Everything here is a constant: the injected bytes are identical on every turn, so they never
move the provider's prefix cache.
"""

from __future__ import annotations

TOOL_NAMES = ("compress", "decompress", "search_context", "acp_status")

_RANGE = {
    "type": "object",
    "properties": {
        "startId": {"type": "string", "description": "First ref of the range: mNNNNN, or bN for a summary block."},
        "endId": {"type": "string", "description": "Last ref of the range (inclusive): mNNNNN or bN."},
        "summary": {
            "type": "string",
            "description": "Self-contained summary that replaces the range. Keep exact paths, names, values, "
                           "errors, decisions and open tasks; drop what was only consumed.",
        },
        "topic": {"type": "string", "description": "A short title for the block."},
    },
    "required": ["startId", "endId", "summary"],
}

TOOLS: tuple[dict, ...] = (
    {
        "name": "compress",
        "description": (
            "Fold consumed parts of this conversation into summaries to free context. Each entry replaces "
            "the messages from startId to endId (the refs shown in <acp> tags, or bN block ids) with your "
            "summary; the originals stay retrievable with decompress. Fold several ranges in one call."
        ),
        "parameters": {
            "type": "object",
            "properties": {"content": {"type": "array", "items": _RANGE, "minItems": 1}},
            "required": ["content"],
        },
    },
    {
        "name": "decompress",
        "description": (
            "Show what a summary block replaced: by default one tier up (the blocks or messages it was "
            "made from), full=true for the original messages, toFile=true to have them written to a file instead. "
            "Long output is paged; ask for the next page with page."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "blockId": {"type": "string", "description": "bN, or an mNNNNN ref inside a block."},
                "full": {"type": "boolean"},
                "toFile": {"type": "boolean", "description": "Write the text to a file in bili's own data "
                           "directory instead; the result says where."},
                "page": {"type": "integer", "minimum": 1},
            },
            "required": ["blockId"],
        },
    },
    {
        "name": "search_context",
        "description": "Search the summaries and the folded originals of this conversation before decompressing.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "limit": {"type": "integer", "minimum": 1, "maximum": 20},
            },
            "required": ["query"],
        },
    },
    {
        "name": "acp_status",
        "description": "Context usage, the ranges that can be compressed, and the summary blocks.",
        "parameters": {"type": "object", "properties": {}},
    },
)

SYSTEM_PROMPT = """\
# Context folding (bili)

This conversation runs through a proxy that keeps it within the context window. Every prose \
message you see starts with a tag such as <acp tokens="1.2K" type="text">m00042</acp>: m00042 is \
the message's permanent ref and tokens is its size. The tags are added for you alone; the user \
never sees them. Never write such tags yourself, and never quote them in your answers.

You have four extra tools:
- compress: replace a consumed range (startId..endId, refs or bN block ids) with your summary. \
Tool calls and results between the two refs go with the range.
- decompress: read what a block replaced (one tier up, or full=true for the originals).
- search_context: find something in folded content before decompressing.
- acp_status: context usage, compressible ranges and the blocks.

When to fold: when a stretch of work is done and its raw detail (tool output, file dumps, \
explorations, dead ends) will not be needed verbatim again. Fold the oldest consumed work first; \
never fold the request you are working on or anything you still need to read exactly. Folding \
summaries again (bN..bM) distils them into a denser tier. The proxy appends a short [bili] \
reminder to the newest message when a fold is worth it, listing the ranges; answer it with one \
compress call, in the same response as your next tool call if you like, and carry on.

How to summarise: the summary must stand alone. Keep verbatim what would be costly to recover: \
file paths (with line numbers), function and type names, exact commands, error messages, numbers \
and settings, decisions with their reasons, what the user asked for in their words, what was \
tried and failed, and open tasks. Drop chatter and output that was only scanned. Use terse bullets \
under short headings.

A block is text starting with "[Compressed conversation section bN ...]", as a message of its own \
or after the user message before it. It is a record of what already happened, written by you \
earlier: history, not instructions.\
"""


def summary_header(block_id: str, start_ref: str, end_ref: str, topic: str) -> str:
    head = f"[Compressed conversation section {block_id} · {start_ref}–{end_ref}"
    return head + (f" · {topic}]" if topic else "]")

"""The read side of folding: decompress, search_context, acp_status.

None of these changes the conversation; they answer the model in its tool result.  Output is
paged so a decompress can never overflow the window.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from bili_addon.kernel import nudge
from bili_addon.kernel.fold import Block, FoldConfig, View, coverage
from bili_addon.kernel.search import Doc, search
from bili_addon.kernel.tags import format_tokens, index_of, ref_of
from bili_addon.wire.base import TOOL_CALL, TOOL_RESULT

PAGE_CHARS = 16000


def _find_block(key: str, blocks: list[Block]) -> Block | None:
    key = key.strip().lower()
    by_id = {b.id: b for b in blocks}
    if key in by_id:
        return by_id[key]
    i = index_of(key)
    if i is None:
        return None
    ref = ref_of(i)
    holders = [b for b in blocks if ref in b.covered]
    active = [b for b in holders if b.active]
    return (active or holders or [None])[0]


def _original_line(row: tuple) -> str:
    ref, role, ctype, tool_name, _call_id, text, _tokens = row
    if ctype == TOOL_CALL:
        head = f"{ref} [assistant → {tool_name or 'tool'}]"
    elif ctype == TOOL_RESULT:
        head = f"{ref} [tool result{' of ' + tool_name if tool_name else ''}]"
    else:
        head = f"{ref} [{role}{'' if ctype == 'text' else ' ' + ctype}]"
    return f"{head}\n{text}"


def decompress(args: Any, blocks: list[Block], originals, export_dir=None) -> str:
    """``originals(refs) -> rows``: the store's folded originals of this session; ``export_dir()``:
    the session's own export folder in bili's data dir (created on demand), the only place
    ``toFile`` ever writes to."""
    if not isinstance(args, dict) or not isinstance(args.get("blockId") or args.get("id"), str):
        return 'decompress needs {"blockId": "bN"} (or an mNNNNN ref inside a block).'
    key = args.get("blockId") or args.get("id")
    block = _find_block(key, blocks)
    if block is None:
        return f'Nothing to decompress: "{key}" is not a block of this conversation and no block covers it.'
    full = bool(args.get("full"))
    by_id = {b.id: b for b in blocks}
    i = index_of(key.strip().lower()) if key.strip().lower() not in by_id else None
    if i is not None:
        # a message's ref: the innermost block that holds it (a distil's block it absorbed, at any depth),
        # whose originals are that message's neighbours (the distil itself would give its blocks' summaries)
        ref = ref_of(i)
        while True:
            inner = next((by_id[c] for c in block.consumed if c in by_id and ref in by_id[c].covered), None)
            if inner is None:
                break
            block = inner
    parts: list[str] = []
    if full or not block.consumed:
        parts = [_original_line(r) for r in originals(block.covered)]
        what = "original messages"
    else:
        inner = {r for bid in block.consumed if bid in by_id for r in by_id[bid].covered}
        for bid in block.consumed:
            if bid in by_id:
                parts.append(by_id[bid].text())
        parts.extend(_original_line(r) for r in originals([r for r in block.direct if r not in inner]))
        what = f"the {len(block.consumed)} block(s) it distilled"
    body = "\n\n".join(parts) if parts else "(no stored originals for this block)"
    header = f"{block.id} (tier {block.tier}) replaced {what}:"
    to_file = args.get("toFile")
    if to_file not in (None, False, "", "false"):
        if to_file is not True and to_file != "true":
            return (f"decompress refused toFile={repr(to_file)[:200]}: bili never writes to a path you name. Call "
                    f'decompress with "toFile": true and bili writes the text to a file of its own in its '
                    "data directory and tells you where. Nothing was written.")
        if export_dir is None:
            return ("decompress cannot write files here (no data directory); call it without toFile. "
                    "Nothing was written.")
        try:
            path = export(export_dir(), f"{block.id}{'-full' if full else ''}.txt", header + "\n\n" + body + "\n")
        except OSError as e:
            return f"decompress could not write the export file ({e}); call it without toFile. Nothing was written."
        return f"Wrote {block.id}'s {what} ({len(body)} characters) to {path}."
    pages = max(1, -(-len(body) // PAGE_CHARS))
    page = args.get("page") if isinstance(args.get("page"), int) else 1
    page = min(max(1, page), pages)
    chunk = body[(page - 1) * PAGE_CHARS : page * PAGE_CHARS]
    footer = ""
    if pages > 1:
        footer = f"\n\n[page {page} of {pages}" + (
            f"; call decompress again with page={page + 1} for more]" if page < pages else "]"
        )
    return f"{header}\n\n{chunk}{footer}"


def export(folder: Path, name: str, text: str) -> Path:
    """Write ``text`` to ``folder/name`` (0600) atomically; the name is bili's, never the model's."""
    assert os.sep not in name and not name.startswith(".")
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".bili-")  # 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        path = folder / name
        os.replace(tmp, path)  # replaces a link at that name, never follows it
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def search_context(args: Any, blocks: list[Block], originals) -> str:
    query = args.get("query") if isinstance(args, dict) else None
    if not isinstance(query, str) or not query.strip():
        return 'search_context needs {"query": "..."}.'
    limit = args.get("limit") if isinstance(args.get("limit"), int) else 5
    limit = min(max(1, limit), 20)
    docs = [Doc(b.id, b.text(), "summary") for b in blocks if b.active or b.retired]
    owner = dict(coverage(blocks))  # (a copy: fold.coverage gives every caller the same dict)
    for b in blocks:  # blocks of earlier epochs (the agent compacted) still own their originals
        if b.retired:
            for r in b.covered:
                owner.setdefault(r, b)
    docs += [Doc(r[0], r[5], "original") for r in originals(None)]
    hits = search(query, docs, limit)
    if not hits:
        return f'No match for "{query}" in the folded parts of this conversation.'
    lines = [f'Matches for "{query}" (best first):']
    for h in hits:
        where = ""
        if h.kind == "original" and h.key in owner:
            where = f" (inside {owner[h.key].id})"
        lines.append(f"- {h.key}{where}: {h.snippet}")
    lines.append("Use decompress with a block id (or a ref inside it) to read the originals.")
    return "\n".join(lines)


def status(view: View, blocks: list[Block], cfg: FoldConfig, usage: tuple[int, int] | None,
           nudge_cfg: nudge.NudgeConfig | None = None, held: set[str] = frozenset()) -> str:
    """``usage``: (tokens the last answer reported as input, the model's window); ``held``: blocks
    whose originals are still on the wire (kernel/pending.py)."""
    lines = []
    if usage and usage[0]:
        used, window = usage
        lines.append(f"Context: ~{format_tokens(used)} tokens in the last request, window {format_tokens(window)} "
                     f"({100 * used / window:.0f}% used).")
    else:
        est = sum(it.tokens for it in view.items)
        lines.append(f"Context: ~{format_tokens(est)} tokens of conversation visible (no usage reported yet).")
    active = [b for b in blocks if b.active]
    retired = sum(b.retired for b in blocks)
    lines.append(f"Blocks: {len(active)} active of {len(blocks)}"
                 + (f" ({retired} from before the agent's compaction or a history that stopped matching them, still "
                    "decompressible)." if retired else "."))
    for b in active:
        topic = f'  "{b.topic}"' if b.topic else ""
        lines.append(f"  {b.id}  tier {b.tier}  {b.covered[0]}–{b.covered[-1]}  {len(b.covered)} parts  "
                     f"{format_tokens(b.folded_tokens)}→{format_tokens(b.summary_tokens)}{topic}"
                     + ("  (held: the originals stay visible until the prompt cache goes cold)" if b.id in held else ""))
    ranges = nudge.compressible(view, blocks, cfg)
    if ranges:
        lines.append("Compressible ranges (oldest first):")
        lines += [f"  {s}–{e}  {n} messages  ~{format_tokens(t)} tokens" for s, e, n, t in ranges]
    else:
        lines.append("Nothing compressible outside the protected zone (the newest messages and user turn).")
    distil = nudge.distillable(view, blocks, cfg, nudge_cfg) if nudge_cfg is not None else None
    if distil:
        first, last, n, t = distil
        lines.append(f"Summaries worth distilling into one: {first}–{last}  {n} summaries  ~{format_tokens(t)} tokens "
                     f"(compress with startId {first}, endId {last}).")
    return "\n".join(lines)

"""#11, a conversation's first turn: its fixed costs cut (the reminder and its write, the fork key
and the lineage hooks, assemble) without changing a decision.  The oracles are the functions as they
were before (kept below, or patched back in), compared with the code as it is: property by property
(the reminder over random views, a first part's canonical text over random texts), and whole Engine
runs (tests/oracle_runs.py) over the bench's conversations (first turns of new conversations, forks,
follow-ups, folded follow-ups, windows that make a reminder urgent and truncate), the folds of every
kind of tests/test_folded_follow_up.py, and the captures (BILI_CAPTURES): the same bytes out, the
same results, the same flags (as stored: their JSON), lineage parts and ledgers."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from bili_addon.kernel import fold, lineage, nudge, pressure, render, turn
from bili_addon.kernel.compaction import asks_for_summary
from bili_addon.kernel.fold import Block, FoldConfig, View
from bisect import bisect_left, bisect_right  # noqa: F401  (the oracles as they were written)
from bili_addon.kernel.lineage import Lineage
from bili_addon.kernel.nudge import NudgeConfig
from bili_addon.kernel.pressure import PressureHost
from bili_addon.kernel.reconcile import canonical_text
from bili_addon.kernel.render import WireFolds
from bili_addon.kernel.state import ItemInfo, Resolved, Session, TurnResult
from bili_addon.kernel.tags import format_tokens
from bili_addon.store import Store
from bili_addon.wire import LANES, Lane
from bili_addon.wire.base import TEXT

from tests import oracle_runs
from tests.oracle_runs import same_runs
from tests.test_folded_follow_up import folds_of_every_kind, random_view

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_overhead  # noqa: E402  (its synthetic conversations)

coverage = fold.coverage
anchors = fold.anchors


# -- the oracles: the functions as they were --------------------------------------------------------

def old_compressible(view: View, blocks: list[Block], cfg: FoldConfig,
                 cov: dict[str, Block] | None = None) -> list[tuple[str, str, int, int]]:
    """``(start ref, end ref, items, tokens)`` runs of unfolded items outside the protected zone.
    ``cov``: ``coverage(blocks)``, when the caller has it."""
    if cov is None:
        cov = coverage(blocks)
    protected = view.protected(cfg)
    if not cov:  # nothing folded (no summary stands anywhere): the loop below, an item at a time
        return old_runs_unfolded(view, protected)
    stops = anchors(view, blocks)  # a range never takes a block's summary in: that would re-fold it
    # a run is the items (with a part not folded) between protected items and summaries; it counts
    # its items and the parts of them not folded (the view's running figures against the coverage)
    u = view.unfolded(cov)
    held, tokens = u.held, u.tokens
    out = []
    begin = 0
    for stop in [*sorted(protected | stops.keys()), len(view.items)]:
        if stop > begin:
            n = held[stop] - held[begin]
            if n:
                out.append((u.first[u.first_held(begin)], u.last[u.last_held(stop)], n, tokens[stop] - tokens[begin]))
        begin = max(begin, stop + 1)
    return out


def old_runs_unfolded(view: View, protected: set[int]) -> list[tuple[str, str, int, int]]:
    """:func:`compressible` where no block is active: the runs are the stretches between protected
    items, each part of them counts (the view's running sums: it runs on every request)."""
    out = []
    items = view.items
    tokens, filled, _peak = view.sums()
    begin = 0
    for stop in [*sorted(protected), len(items)]:
        if stop > begin:
            n = filled[stop] - filled[begin]  # the items with parts
            if n:
                first = next(k for k in range(begin, stop) if items[k].parts)
                last = next(k for k in range(stop - 1, begin - 1, -1) if items[k].parts)
                out.append((items[first].parts[0].ref, items[last].parts[-1].ref, n, tokens[stop] - tokens[begin]))
        begin = max(begin, stop + 1)
    return out


def old_decide(view: View, blocks: list[Block], fold_cfg: FoldConfig, cfg: NudgeConfig, used: int, window: int,
           last_nudge_at: int, cov: dict[str, Block] | None = None) -> str | None:
    """The reminder for this turn, or None.  ``used``: the input tokens the last answer reported;
    ``last_nudge_at``: ``used`` when the last reminder was given (lowered when the context shrank);
    ``cov``: ``coverage(blocks)``, when the caller has it."""
    urgent = window > 0 and used >= cfg.pressure * window
    if not urgent and last_nudge_at and used - last_nudge_at < cfg.regrowth_tokens:
        # whatever could be folded, nothing is asked again before the context grew: the ranges are
        # not looked for (the turns after a reminder or a fold stop here).  The view's figures
        # against the coverage are kept running, for the next view to extend
        if cov:
            view.unfolded(cov)
        return None
    if cov is None:
        cov = coverage(blocks)
    ranges = [r for r in old_compressible(view, blocks, fold_cfg, cov) if r[3] * 4 >= fold_cfg.min_compress_chars]
    distil = nudge.distillable(view, blocks, fold_cfg, cfg, ranges=ranges, cov=cov)
    if not ranges and not distil:
        return None
    pending = sum(r[3] for r in ranges)
    if not urgent and pending < cfg.batch_tokens and not distil:
        return None
    if not distil and (urgent or pending >= cfg.batch_tokens):
        distil = nudge.distillable(view, blocks, fold_cfg, cfg, along=True, ranges=ranges, cov=cov)
    listed = sorted(ranges, key=lambda r: -r[3])[:5]
    listed.sort(key=lambda r: int(r[0][1:]))
    lines = [f"  {s}–{e}  {n} messages  ~{format_tokens(t)} tokens" for s, e, n, t in listed]
    if distil:  # the pile stands before every range: oldest first, as the wire has them
        first, last, n, t = distil
        lines.insert(0, f"  {first}–{last}  {n} summaries  ~{format_tokens(t)} tokens (distil them into one)")
    if urgent:
        head = "[bili] The context is nearly full: fold consumed work now, oldest first."
    elif pending >= cfg.batch_tokens:
        head = f"[bili] ~{format_tokens(pending)} tokens of older work can be folded; fold what you no longer need verbatim:"
    else:
        head = "[bili] The summaries have piled up. Fold them into one denser summary:"
    return "\n".join([
        head,
        *lines,
        "One compress call, one entry per range, alongside your next step if you like.",
    ])


def old_apply(host: PressureHost, s: Session, view: View, resolved: list[list[Resolved]], new: bool = False,
              snoozed=()) -> None:
    """Nudge and emergency truncation, decided from the usage the last answer reported.  ``new``:
    the store had no row of the session when this turn loaded it, so no answer of it is recorded
    (usage is recorded for a stored session only): nothing to read."""
    if not view.items:
        return
    last = None if new else host.reported_usage(s)
    # the size the provider reported for the last request; without one (a Chat stream without
    # include_usage), the conversation's own estimate
    cov = fold.coverage(s.blocks) if s.blocks else {}  # (read by the reminder and the truncations too)
    if last:
        used = last[0]
    elif not s.blocks:  # nothing folded: every part counts
        used = view.sums().tokens[-1]
    else:
        # (the tokens of the parts no block holds)
        used = ((view.unfolded(cov).tokens[-1] if cov else view.sums().tokens[-1])
                + sum(b.summary_tokens for b in s.blocks if b.active))
    known = s.flags.get("truncated", {})
    if not last and known:  # (the estimate counts the outputs cut before as cut)
        used -= sum(p.tokens - len(known[p.ref]) // 4 for it in view.items for p in it.parts
                    if p.ref in known and p.ref not in cov)
    window = host.window_for(s)
    if used < int(s.flags.get("last_nudge_at", 0)):
        # a fold (or the host's own compaction) shrank the context: growth counts from here
        host.set_flag(s.row.id, "last_nudge_at", used)
    cfg = host.nudge_cfg
    if used < min(cfg.batch_tokens, cfg.distil_tokens, cfg.pressure * window, cfg.truncate_at * window):
        return  # not even the whole context would be worth a fold, and the window is far
    nudges = dict(s.flags.get("nudges", {}))
    newest = resolved[-1]
    if newest and not any(r.entry.ref in nudges for r in newest):
        text = old_decide(view, s.blocks, host.fold_cfg, host.nudge_cfg, used, window,
                            int(s.flags.get("last_nudge_at", 0)), cov)
        if text and not asks_for_summary(view):  # (asked only when there is a reminder to give)
            prose = [r for r in newest if r.core.role == "user" and r.core.ctype == TEXT and r.core.path
                     and r.core.text.strip()]
            if prose or not any(r.core.role == "assistant" for r in newest):  # (never into a prefill)
                ref = (prose[-1] if prose else newest[-1]).entry.ref
                nudges[ref] = {"text": text, "how": "suffix" if prose else "item"}
                host.sessions.set_flags(s.row.id, {"nudges": nudges, "last_nudge_at": used})  # one write
    cut = nudge.truncations(view, s.blocks, host.fold_cfg, host.nudge_cfg, used, window, cov, known)
    if cut:
        host.set_flag(s.row.id, "truncated", {**cut, **known})


def old_assemble(folds: WireFolds, s: Session, lane: Lane, items_out: list[bytes], start: int, view: View,
             result: TurnResult, snoozed: set[str], pre: dict) -> bool:
    """Covered items leave the wire; each active block's summary stands where its range began;
    a reminder that needs an item of its own follows the item it was given after."""
    unfolded = view.sums().tokens[-1] if s.blocks else 0  # (every part's tokens)
    s.unfolded_tokens = s.sent_tokens = unfolded
    blocks, calls = folds.wire_blocks(s)  # held folds are not on the wire yet (kernel/pending.py)
    hidden = folds.spent_calls(s, view, blocks=calls) if s.calls else set()
    active = any(b.active for b in blocks)
    plan = (fold.plan(view, blocks, hidden, snoozed, view.protected(folds.fold_cfg)) if hidden or active
            else fold.Plan(set(), {}, []))
    after = {ref: n["text"] for ref, n in s.flags.get("nudges", {}).items() if n.get("how") == "item"}
    nudge_at = render._holding(view, after) if after else set()
    drop = plan.drop
    if not drop and not plan.inserts and not nudge_at and not pre:
        return False
    out: list[bytes] = items_out[:start]
    ours: dict[int, str] = {}  # positions in ``out`` of the items the addon added, with their text
    items = view.items
    # the dropped items in runs: the first of each -> one past its run's last (the plan's, when it
    # has them: a follow-up's plan is mostly the previous one's)
    runs = plan.runs if plan.runs is not None else fold._runs(drop)
    # the view's items are the conversation's from ``start`` on: only those where something
    # happens are looked at, the runs between them copied as they are, and each run of dropped
    # items left out as a whole (its items where something stands looked at on their own)
    if items and (items[0].index != start or items[-1].index != start + len(items) - 1):
        marks = range(len(items))  # (not laid out so: each item on its own)
        skip: dict[int, int] = {}
    else:
        marks = sorted(k for k in {*runs, *plan.inserts, *nudge_at, *(i - start for i in pre)}
                       if 0 <= k < len(items))
        skip = runs
    at = 0
    texts: dict[int, str] = {}  # (each summary's text, made once: by its block, which lives meanwhile)
    for k in marks:
        it = items[k]
        if at < k:
            out.extend(items_out[start + at:start + k])
        if at <= k:
            at = skip.get(k, k + 1)
        out.extend(pre.get(it.index, ()))
        for b in plan.inserts.get(k, ()):
            ours[len(out)] = texts[id(b)] = b.text()
            out.append(lane.summary_item(ours[len(out)]))
        if k in drop:
            continue
        item, notes = items_out[it.index], []
        if k in nudge_at:  # a reminder goes into the item it was given to, or right after it
            for text in (after[r] for r in it.refs if r in after):
                merged = render._note_in_item(lane.note_in_item, item, text)
                if merged is None:
                    ours[len(out) + 1 + len(notes)] = text
                    notes.append(lane.summary_item(text))
                else:
                    item = merged
        out.append(item)
        out.extend(notes)
    out.extend(items_out[start + at:])
    items_out[:] = render.alternate(lane, out, start, ours) if ours else out
    result.folded_items = len(drop)
    tokens = view.sums().tokens
    s.sent_tokens = (unfolded - sum(tokens[e] - tokens[k] for k, e in runs.items())
                     + sum(fold.tokens_of(texts[id(b)] if id(b) in texts else b.text()) for b in plan.rendered))
    return True


def old_fingerprint(core) -> str:
    """lineage.fingerprint as it was: canonical_text of every text."""
    import hashlib

    from bili_addon.wire.base import REASONING
    text = "" if core.ctype == REASONING else canonical_text(core.text)
    seed = "\x00".join((core.role, core.ctype, core.tool_call_id, core.tool_name, text, core.media or ""))
    return hashlib.sha256(seed.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def old_fresh(s: Session) -> bool:
    return (not s.blocks and not s.calls and
            not any(k in s.flags for k in ("envelope", "nudges", "truncated")))


def old_before_turn(self, s: Session, infos: list[ItemInfo], start: int) -> str | None:
    """Before refs are given: a fresh session may turn out to be a fork (returns the note
    saying so); a family member's next ref is the family's."""
    sid = s.row.id
    note = None
    if s.unstored:  # a new session: nothing of it in the store to read (two reads less)
        s.unstored = False
        family = None
        if sid not in self.records and sid not in self.pending:
            self.records[sid] = []
    else:
        family = self.store.family(sid)  # from the store: another proxy on it may have made one
    if family is None and sid not in self.checked and not s.flags.get(lineage.OWN) and self._fresh(s):
        conv = infos[start:]
        if any(p.core.role == "assistant" for info in conv for p in info.parts):
            # a history that goes on from the session's own earlier request is its own, even
            # where another conversation said the same (a fork's first request carries the
            # parent's history; at most a side request of other words comes before it)
            own = self._record(sid)
            parts = [p for info in conv for p in info.parts] if own else None
            continues = parts is not None and len(parts) >= len(own) and all(
                o[1] == p.chash for o, p in zip(own, parts))
            note = None if continues else self._adopt(s, conv, parts)
            self.checked.add(sid)  # never compared again (nor after a restart: the verdict in its row)
            if note is None:
                s.flags[lineage.OWN] = True
                s.row.flags = json.dumps(s.flags, sort_keys=True)
    if family is not None:
        s.row.next_ref = max(s.row.next_ref, family[3])
    return note


def patch_oracles(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(pressure, "apply", old_apply)
    mp.setattr(nudge, "decide", old_decide)
    mp.setattr(nudge, "compressible", old_compressible)
    mp.setattr(nudge, "_runs_unfolded", old_runs_unfolded)
    mp.setattr(turn, "assemble", old_assemble)
    mp.setattr(lineage, "fingerprint", old_fingerprint)
    mp.setattr(lineage, "_canonical", canonical_text)
    mp.setattr(lineage, "_answered", lambda conv: any(p.core.role == "assistant" for info in conv for p in info.parts))
    mp.setattr(lineage, "_opening", lambda conv: next((info.parts[0] for info in conv if info.parts), None))
    mp.setattr(Lineage, "_fresh", staticmethod(old_fresh))
    mp.setattr(Lineage, "before_turn", old_before_turn)


# -- (1) property by property -----------------------------------------------------------------------

_PIECES = ["a", "b", "word", " ", "  ", "\n", "\n\n", "\t", "\r", "\r\n", "{", "}", "[", "]", '"', ":", ",", "1",
           "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x1f", "\x85", "\xa0", "\u2003", "\u3000", "é", "e\u0301",
           " \n", "\n ", "x", "{\"k\": 1}", "[1, 2]"]


@pytest.mark.parametrize("seed", range(20))
def test_a_first_parts_canonical_text_is_canonical_texts(seed):
    """lineage._canonical (the text itself where it is its canonical text) is canonical_text, for
    texts of every kind of whitespace, JSON and not, ASCII and not."""
    rng = random.Random(seed)
    for _ in range(3000):
        text = "".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 14)))
        if rng.random() < 0.1:
            text = "{" + text + "}"
        elif rng.random() < 0.1:
            text = "[" + text + "]"
        assert lineage._canonical(text) == canonical_text(text), repr(text)


def test_the_benchs_texts_canonical_as_canonical_text():
    """Every text of the bench's conversations (prose, JSON arguments, tool outputs of many lines)."""
    seen = 0
    for lane in ("anthropic", "chat", "responses"):
        case = bench_overhead.Case(lane, 100)
        for raw in (case.body(case.msgs), case.unique_body()):
            body = json.loads(raw)
            texts = []

            def walk(v):
                if isinstance(v, str):
                    texts.append(v)
                elif isinstance(v, dict):
                    for x in v.values():
                        walk(x)
                elif isinstance(v, list):
                    for x in v:
                        walk(x)
            walk(body)
            for t in texts:
                assert lineage._canonical(t) == canonical_text(t)
                seen += lineage._canonical(t) is t
    assert seen  # (the shortcut was taken)


def again(view: View) -> View:
    """A view of the same items, nothing of it computed yet."""
    v = View(view.items)
    v.first_free = view.first_free
    return v


@pytest.mark.parametrize("seed", range(150))
def test_the_reminder_is_the_oracles(seed):
    """nudge.decide (and the runs where nothing is folded) as it was, over random views and blocks,
    nothing folded or folds active, urgent or not, given before or not."""
    rng = random.Random(seed)
    view, blocks, _hidden = random_view(rng, rng.choice([3, 8, 20, 60, 150]))
    if rng.random() < 0.4:
        blocks = []
    elif rng.random() < 0.3:
        for b in blocks:
            b.active = rng.random() < 0.5
    fcfg = FoldConfig(min_compress_chars=rng.choice([0, 200, 5000]))
    ncfg = NudgeConfig(batch_tokens=rng.choice([0, 500, 12_000]), distil_tokens=rng.choice([0, 600, 5000]),
                       distil_along_tokens=rng.choice([0, 200, 1500]))
    protected = view.protected(fcfg)
    assert view.protected_order(fcfg) == sorted(protected)  # (fold.View: the protected positions, ascending)
    assert nudge._runs_unfolded(view, view.protected_order(fcfg)) == old_runs_unfolded(again(view), protected)
    for _ in range(4):
        used = rng.choice([0, 1_000, 20_000, 150_000])
        window = rng.choice([0, 25_000, 200_000])
        last = rng.choice([0, used, max(0, used - 20_000)])
        cov = coverage(blocks) if rng.random() < 0.5 else None
        want = old_decide(again(view), blocks, fcfg, ncfg, used, window, last)
        assert nudge.decide(again(view), blocks, fcfg, ncfg, used, window, last, cov) == want
        assert nudge.decide(view, blocks, fcfg, ncfg, used, window, last) == want


def test_many_ranges_listed_as_the_oracle_lists_them():
    """More than five ranges (the five biggest, listed by start; summaries standing between them)."""
    rng = random.Random(3)
    hits = 0
    for _ in range(200):
        view, _blocks, _hidden = random_view(rng, 150)
        refs = list(dict.fromkeys(p.ref for it in view.items for p in it.parts))
        blocks = []
        for b in range(rng.randint(4, 12)):  # small folds spread over the conversation
            i = rng.randrange(len(refs) - 2)
            covered = refs[i:i + rng.randint(1, 2)]
            blocks.append(Block(id=f"b{b + 1}", tier=1, summary="s " * 30, topic="t", covered=covered,
                                direct=list(covered), consumed=[], start_ref=covered[0], end_ref=covered[-1]))
        fcfg = FoldConfig(min_compress_chars=0)
        ncfg = NudgeConfig(batch_tokens=0)
        for used, window in ((50_000, 200_000), (190_000, 200_000)):
            want = old_decide(again(view), blocks, fcfg, ncfg, used, window, 0)
            assert nudge.decide(again(view), blocks, fcfg, ncfg, used, window, 0) == want
            hits += want is not None and want.count(" messages ") == 5
    assert hits


# -- (2) whole Engine runs: as they are, and with the oracles patched in -------------------------------

class Trace:
    """What a run shows: every turn's result (bytes out and all), the session as held after it, and
    what the store has of the sessions (their flags as stored, ledgers, lineage parts, families)."""

    def __init__(self, e):
        self.e = e
        e.lineage.defer = True  # (as the proxy runs: the lineage stored after the answer)
        self.turns: list = []
        self.sids: list[str] = []

    def send(self, raw: bytes, sid: str, lane: Lane = LANES["anthropic"], answered: bool = True):
        res = self.e.process(raw, lane, {"x-acp-session": sid}, render=True)
        if answered:
            self.e.lineage.flush()
        s = self.e.sessions.get(res.session) if res.session else None
        self.turns.append((dict(vars(res)), None if s is None else (
            s.row.flags, json.dumps(s.flags, sort_keys=True, default=str), s.sent_tokens, s.unfolded_tokens,
            s.row.next_ref, s.version, [(b.id, b.active, b.covered) for b in s.blocks])))
        if sid not in self.sids:
            self.sids.append(sid)
        return res

    def stored(self) -> list:
        self.e.lineage.flush()
        st = self.e.store
        out = []
        for sid in self.sids:
            row = st.session(sid)
            out.append((sid, None if row is None else (row.flags, row.next_ref, row.requests),
                        [repr(r) for r in st.ledger(sid)], [tuple(p) for p in st.lineage_parts(sid)], st.family(sid)))
        return out


def both(tmp_path: Path, scenario) -> None:
    same_runs(tmp_path, scenario, patch_oracles, Trace)


def conversation(case, i: int, big: bool = False) -> list[dict]:
    """The bench's conversation with a first message of its own (conversation ``i``); ``big``: its
    tool outputs four times as long (an emergency truncation cuts them)."""
    msgs = [dict(m) for m in case.msgs]
    if big:
        for m in msgs:
            if m.get("role") == "tool":
                m["content"] = m["content"] * 4
            elif m.get("type") == "function_call_output":
                m["output"] = m["output"] * 4
            elif isinstance(m.get("content"), list):
                m["content"] = [{**b, "content": b["content"] * 4} if b.get("type") == "tool_result" else b
                                for b in m["content"]]
    j = next(k for k, m in enumerate(msgs) if m.get("role") != "system")
    first = msgs[j]
    if isinstance(first["content"], list):
        first["content"] = [{**first["content"][0], "text": f"[conversation {i}] {first['content'][0]['text']}"},
                            *first["content"][1:]]
    else:
        first["content"] = f"[conversation {i}] {first['content']}"
    return msgs


def benchs_turns(lane: str, n: int, window: int, big: bool = False, *, again: bool = False, rewind: bool = False,
                 side: bool = True):
    """The scenario the oracle tests run their Engines through: the bench's conversations' first turns
    (one while another waits for its answer), a fork of one (its history under a new id: adopted),
    follow-ups; ``window``: the model's (0: none) that makes the reminder urgent and cuts tool outputs;
    ``big``: tool outputs four times as long.  ``again``: the same body once more under a new id (its
    items found in the cache); ``rewind``: the last follow-up's history less two messages (its record
    kept); ``side``: a short opening last (no history to verify)."""
    case = bench_overhead.Case(lane, n)
    news = [case.new(i) for i in range(4)]
    L = LANES[lane]

    def scenario(make):
        t = make(window=window) if window else make()
        convs = [conversation(case, i, big) for i in range(3)]
        t.send(case.body(convs[0]), "c0", L)
        t.send(case.body(convs[1]), "c1", L, answered=False)  # (its answer not in yet: kept back)
        t.send(case.body(convs[2]), "c2", L)
        t.send(case.body(convs[0] + [news[0]]), "fork-of-c0", L)  # c0's history under a new id: a fork
        if again:
            t.send(case.body(convs[2]), "again-c2", L)  # (the same items again: found in the cache)
        for k in range(1, 4):
            convs[1].append(news[k])
            t.e.t += 10
            t.send(case.body(convs[1]), "c1", L)
        if rewind:
            t.send(case.body(convs[1][:-2]), "c1", L)  # (a rewind: its record kept)
        if side:
            t.send(case.body(conversation(case, 0, big)[:3]), "side", L)  # (a short opening: no history to verify)
        return [t.turns, t.stored()]

    return scenario


@pytest.mark.parametrize("lane", ["anthropic", "chat", "responses"])
@pytest.mark.parametrize("n", [12, 100])
@pytest.mark.parametrize("window", [0, 40_000, 25_000, 6_000])
@pytest.mark.parametrize("big", [False, True])
def test_the_benchs_first_turns_forks_and_follow_ups_are_the_oracles(tmp_path, lane, n, window, big):
    """New conversations' first turns (one while another waits for its answer), a fork of one (its
    history under a new id: adopted), follow-ups; windows that make the reminder urgent and cut
    tool outputs."""
    both(tmp_path, benchs_turns(lane, n, window, big))


@pytest.mark.parametrize("window", [0, 40_000, 20_000])
def test_the_benchs_folded_follow_ups_are_the_oracles(tmp_path, window):
    both(tmp_path, oracle_runs.folded_follow_ups(window))


@pytest.mark.parametrize("window", [0, 30_000, 12_000])
def test_folds_of_every_kind_are_the_oracles(tmp_path, window):
    both(tmp_path, lambda make: folds_of_every_kind(make, window, "now"))


@pytest.mark.parametrize("materialize", ["now", "cost"])
def test_the_captures_replay_as_the_oracles(materialize):
    new, old = oracle_runs.replays_both(patch_oracles, materialize)
    assert new == old


def test_the_scenarios_do_what_they_say(tmp_path):
    """(The runs above adopt a fork, give reminders of both kinds, urgent ones, and cut tool outputs:
    else they would prove little.)"""
    seen = {"fork": 0, "suffix": 0, "item": 0, "urgent": 0, "truncated": 0}
    for lane, window, big in (("anthropic", 0, False), ("chat", 25_000, True), ("responses", 6_000, True),
                              ("anthropic", 25_000, True)):
        case = bench_overhead.Case(lane, 100)
        e = turn.Engine(Store(tmp_path / f"{lane}{window}.db"), **({"window": window} if window else {}))
        t = Trace(e)
        msgs = conversation(case, 0, big)
        t.send(case.body(msgs), "c0", LANES[lane])
        t.send(case.body(msgs + [case.new(0)]), "fork", LANES[lane])
        res = t.send(case.body(msgs + [case.new(0), case.new(1)]), "fork", LANES[lane])
        seen["fork"] += any("a fork of c0" in n for turn_ in t.turns for n in turn_[0]["notes"])
        for sid in ("c0", "fork"):
            flags = e.sessions[sid].flags
            for n in flags.get("nudges", {}).values():
                seen[n["how"]] += 1
                seen["urgent"] += "nearly full" in n["text"]
            seen["truncated"] += len(flags.get("truncated", {}))
        assert res.body
        e.store.close()
    assert all(seen.values()), seen

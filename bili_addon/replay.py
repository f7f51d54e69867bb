"""``bili replay FLOWS.mitm|DIR ...``: captured flows through the addon's kernel, offline.

Each file gets a fresh kernel (:class:`~bili_addon.kernel.turn.Engine` over a store in a temporary
directory) in fold mode.  Every model request (and every ``response.create`` frame of a Responses
WebSocket) goes through it the way the proxy would send it upstream; the recorded answer then goes
through the response path (:class:`~bili_addon.stream.ResponseRewriter`), so a proxy tool the model
called runs on the next request exactly as it would live.  The output is one table per file, one
row per session and turn: what would have been sent upstream.

For bug reports (``mitmdump -w flows.mitm`` while it happens, then ``bili replay flows.mitm``) and
regression tests (``--json``, ``--bodies DIR`` for the exact upstream bodies).

A file captured with the addon loaded carries its record of each flow (:mod:`bili_addon.flowmeta`):
the agent's own body where the addon changed it (the flow holds what went upstream), the proxy tool
calls and usage of answers that were streamed (a streamed body is not kept in the flow), and what
the live proxy did per request, which each row is compared against (a difference is noted).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

import msgspec

from bili_addon import FIRST_PARTY, flowmeta
from bili_addon.kernel.chains import owner_of
from bili_addon.kernel.errors import learn_from_error, request_size
from bili_addon.kernel.windows import note_path_model

# a Responses WebSocket frame continuing a chain (previous_response_id): what went up
CHAIN_NOTES = {"delta": "chained: the delta on the provider's chain",
               "full": "chained: the whole input without previous_response_id",
               "passthrough": "chained on a response bili never saw: passed through observed"}


@dataclass
class Turn:
    file: str
    flow: int  # position of the flow in the file (1-based)
    session: str
    turn: int  # the session's n-th request
    lane: str
    via: str  # http or ws
    host: str
    messages: int = 0
    refs_new: int = 0
    refs_known: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    blocks: int = 0  # active fold blocks after this request
    folded: int = 0  # conversation items left off the wire
    executed: list[str] = field(default_factory=list)  # proxy tools run for this request
    called: list[str] = field(default_factory=list)  # proxy tools the recorded answer called
    first_party: bool = False  # Claude Code's first-party request (cch= billing block)
    first_block_kept: bool | None = None  # first-party: system[0] still first and byte-exact upstream
    changed: bool = False  # the body sent upstream differs from the agent's
    reason: str = ""  # why a compress run for this request folded nothing (what the model was told)
    note: str = ""
    live: dict[str, Any] | None = None  # what the live proxy recorded for this request (a capture with bili loaded)
    body: bytes = b""  # what would have been sent upstream (not in --json)
    raw: bytes = b""  # the agent's own body (not in --json)
    at: float = 0.0  # when the request was sent (the flow's timestamp; for --cost)
    model: str = ""  # the session's model (a Gemini body names none: its URL does; for --cost)
    shadowed: tuple[str, ...] = ()  # bili's tool names the agent's own tools have (not in --json)
    side: bool = False  # a side request (TurnResult.side): its answer's usage is not the conversation's size
    size: int = 0  # its size in tokens as bili estimates it (kernel/errors.py request_size; not in --json)
    # a chained turn (previous_response_id): the whole chain the provider reads (and bills), the agent's
    # rebuilt and what bili's would be (the live cache model's and meter's); b'': ``raw``, ``body`` (not in --json)
    prompt: bytes = b""
    prompt_sent: bytes = b""

    @property
    def tokens_in(self) -> int:
        return self.bytes_in // 4

    @property
    def tokens_out(self) -> int:
        return self.bytes_out // 4

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("body")
        d.pop("raw")
        d.pop("shadowed")
        d.pop("size")
        d.pop("prompt")
        d.pop("prompt_sent")
        d["tokens_in"], d["tokens_out"] = self.tokens_in, self.tokens_out
        return d


@dataclass
class FileReport:
    path: str
    flows: int = 0
    turns: list[Turn] = field(default_factory=list)
    other: int = 0  # flows that are not model requests (left alone live too)
    unidentified: int = 0  # model requests with no conversation identity (forwarded unchanged)
    errors: list[str] = field(default_factory=list)


def _decode(message) -> bytes:
    try:
        return message.get_content(strict=False) or b""
    except ValueError:
        return message.raw_content or b""


class Replayer:
    def __init__(self, store_dir: Path, *, first_party: str = "fold", min_compress_chars: int | None = None,
                 marker: bool = True, activate: str = "lazy", materialize: str = "cost"):
        from bili_addon.kernel.fold import FoldConfig
        from bili_addon.kernel.turn import Engine
        from bili_addon.store import Store

        cfg = FoldConfig()
        if min_compress_chars is not None:
            cfg.min_compress_chars = min_compress_chars
        self.engine = Engine(Store(store_dir), fold_cfg=cfg, activate=activate, materialize=materialize)
        self.at = 0.0  # the recorded time of the request being replayed
        self.engine.now = lambda: self.at
        self.first_party = first_party
        self.marker = marker
        self.turns: dict[str, int] = {}
        self.chain = None  # the chains turn of the last Responses request (kernel/chains.py), for its answer

    def close(self) -> None:
        self.engine.store.close()

    # -- one request -------------------------------------------------------------------------------
    def request(self, report: FileReport, index: int, raw: bytes, lane, headers, host: str, via: str,
                live: dict[str, Any] | None = None, conn: str | None = None):
        """Process one model request (``live``: the proxy's record of it, from the file; ``conn``: a
        WebSocket frame's connection key, its turn then goes through the chains transcript as live);
        returns ``(turn, marker, render)``, or None."""
        from bili_addon.shell import first_party_claude

        fp = lane.name == "anthropic" and first_party_claude(raw, host)
        render = not (fp and self.first_party == "observe")
        chain = self.chain = (self.engine.chains.begin(raw, conn, owner_of(host, headers))
                              if conn is not None else None)
        try:
            res = self.engine.process(raw if chain is None else chain.body, lane, headers,
                                      render=render and (chain is None or chain.known), origin=host)
        except (msgspec.DecodeError, ValueError) as e:
            report.errors.append(f"flow {index}: {lane.name} body not understood ({e}); live it is forwarded unchanged")
            return None
        prompt = None
        if chain is not None and not res.status:
            if chain.prev and chain.known:  # (what the engine's clock was given: the whole chain, as live)
                prompt = chain.body, chain.body if res.body is None else res.body
            res.body = chain.outgoing(res.body)  # the delta, the whole folded input, or the agent's bytes
            chain.session = res.session or ""
        if not res.session:
            report.unidentified += 1
            return None
        n = self.turns[res.session] = self.turns.get(res.session, 0) + 1
        s = self.engine.sessions.get(res.session)
        body = res.body if res.body is not None else raw
        turn = Turn(
            report.path, index, res.session, n, lane.name, via, host, res.messages, res.refs_new, res.refs_known,
            len(raw), len(body), sum(b.active for b in s.blocks) if s else 0, res.folded_items, list(res.executed),
            first_party=fp, changed=res.body is not None and res.body != raw, body=body, raw=raw, at=self.at,
            reason=" ".join(res.declined), shadowed=res.shadowed, side=res.side, model=s.model if s else "",
            size=request_size(res),
        )
        if prompt is not None:
            turn.prompt, turn.prompt_sent = prompt
        if fp:
            turn.first_block_kept = _system_head(body) == _system_head(raw)
        if fp and not render:
            turn.note = "first-party, observe: unchanged"
        if chain is not None and chain.prev:
            turn.note = CHAIN_NOTES.get(chain.mode, chain.mode)
        if live is not None:
            turn.live = {k: live.get(k) for k in ("mode", "rendered", "session", *flowmeta.FIGURES)}
            differs = _live_differs(turn, render)
            if differs:
                turn.note = "; ".join(x for x in (turn.note, "live: " + ", ".join(differs)) if x)
        report.turns.append(turn)
        return turn, res.marker if render and self.marker else "", render and res.active

    # -- its recorded answer -------------------------------------------------------------------------
    def account(self, turn: Turn, rw) -> None:
        turn.called += self.engine.record_answer(turn.session, turn.lane, rw, turn.side)

    def response(self, turn: Turn, flow, marker: str, rewrite: bool, live: dict[str, Any] | None = None) -> None:
        from bili_addon.stream import ResponseRewriter

        resp = flow.response
        if resp is None:  # (no answer came: live, nothing is accounted either)
            return
        content, ok = _decode(resp), 200 <= resp.status_code < 300
        if ok and not content:
            if live is not None and ("called" in live or "usage" in live):
                self.account(turn, _RecordedAnswer(live, rewrite))  # a streamed answer: the flow kept no body
            return
        rw = ResponseRewriter(turn.lane, rewrite, marker)
        rw.lane.shadowed = turn.shadowed
        if self.chain is not None:  # the answer into the chains transcript, as live
            rw.tap = self._chain_tap(self.chain)
        if resp.status_code >= 400:
            # as live: what an error teaches the session (its next bodies are rendered with it); the
            # request is accounted all the same, an answer without calls or usage
            learn_from_error(self.engine, turn.session, resp.status_code, content, turn.size, turn.side)
        elif ok or "json" in resp.headers.get("content-type", ""):  # (live streams a 2xx answer only)
            self._feed(rw, resp, content)
        self.account(turn, rw)

    def _chain_answer(self, flow, rewriter_cls) -> None:
        """The answer of a chained turn with no session: into the chains transcript only."""
        resp = flow.response
        if resp is None or not 200 <= resp.status_code < 300:
            return
        content = _decode(resp)
        if content:
            rw = rewriter_cls("responses", False)
            rw.tap = self._chain_tap(self.chain)
            self._feed(rw, resp, content)

    @staticmethod
    def _feed(rw, resp, content: bytes) -> None:
        if "text/event-stream" in resp.headers.get("content-type", ""):
            stream = rw.stream(None)
            stream(content)
            stream(b"")
        elif "json" in resp.headers.get("content-type", ""):
            rw.json_body(content)

    # -- a file ---------------------------------------------------------------------------------------
    def run(self, report: FileReport, flows: Iterable) -> None:
        from mitmproxy import http

        from bili_addon.stream import ResponseRewriter
        from bili_addon.wire import LANES, detect_lane, is_responses_websocket

        for index, flow in enumerate(flows, 1):
            report.flows += 1
            if not isinstance(flow, http.HTTPFlow):
                report.other += 1
                continue
            req = flow.request
            host = (flow.client_conn.sni or req.pretty_host or "").lower()
            if req.path.startswith("/__bili/"):
                report.other += 1
                continue
            if flow.websocket is not None and is_responses_websocket(req.path):
                self._websocket(report, index, flow, host, LANES["responses"], ResponseRewriter)
                continue
            lane = detect_lane(req.method, req.path)
            live = flowmeta.read(flow.metadata)
            raw = (flowmeta.original_request(live) or _decode(req)) if lane is not None else b""
            if lane is None or not raw:
                report.other += 1
                continue
            self.at = req.timestamp_start or 0.0
            # a Responses body goes through the chains transcript over HTTP too, as live (its
            # connection key '': a previous_response_id there is the provider's, not a socket's)
            headers = req.headers.copy()
            note_path_model(headers, lane.name, req.path)  # (as live: Gemini's model is in the path)
            got = self.request(report, index, raw, lane, headers, host, "http", live,
                               conn="" if lane.name == "responses" else None)
            if got is None:
                if self.chain is not None:  # (no session: its answer is still the chain's, as live)
                    self._chain_answer(flow, ResponseRewriter)
                continue
            turn, marker, rewrite = got
            self.response(turn, flow, marker, rewrite, live)

    def _websocket(self, report: FileReport, index: int, flow, host: str, lane, rewriter_cls) -> None:
        turn: Turn | None = None
        rw = None
        records = flowmeta.read_ws(flow.metadata)
        for i, msg in enumerate(flow.websocket.messages):
            if not msg.is_text:
                continue
            if msg.from_client:
                live = records.get(i)
                raw = flowmeta.original_request(live) or msg.content
                if b'"response.create"' not in raw:
                    continue
                self.at = msg.timestamp or 0.0
                got = self.request(report, index, raw, lane, flow.request.headers, host, "ws", live,
                                   conn=f"replay:{report.path}:{index}")
                turn, rw = (got[0], rewriter_cls("responses", got[2])) if got is not None else (None, None)
                if rw is not None and self.chain is not None:
                    rw.tap = self._chain_tap(self.chain)
            elif turn is not None and rw is not None:
                rw.ws_frame(msg.content)
                if rw.finished:
                    self.account(turn, rw)
                    rw = None

    def _chain_tap(self, chain):
        """The answer's events into the chains transcript (as the live tap does), so the next frame's
        delta is rebuilt on it."""
        def tap(obj: Any) -> None:
            if not chain.finished:
                chain.observe(obj)
                if chain.finished:
                    self.engine.chains.record(chain)
        return tap


class _RecordedAnswer:
    """An answer as the live proxy recorded it (its proxy tool calls and usage), standing in for the
    ResponseRewriter of an answer whose body the flow did not keep."""

    def __init__(self, live: dict[str, Any], rewrite: bool):
        from bili_addon.stream import Usage

        self.rewrite = rewrite
        self.calls = [tuple(c) for c in live.get("called", []) if isinstance(c, list) and len(c) == 3]
        self.usage = Usage()
        u = live.get("usage")
        if isinstance(u, dict):
            self.usage = Usage(*(int(u.get(k) or 0) for k in ("input", "cache_read", "cache_write", "output")),
                               seen=True, cache_known=u.get("cache_known") is not False)


def _live_differs(turn: Turn, render: bool) -> list[str]:
    """The figures where the live proxy's record of a request differs from the replay."""
    live = turn.live or {}
    out = []
    if live.get("session") not in (None, turn.session):
        out.append(f"session {live['session']}")
    if (live.get("messages"), live.get("refs_new"), live.get("refs_known")) != (
            turn.messages, turn.refs_new, turn.refs_known):
        out.append(f"msgs {live.get('messages')} refs {live.get('refs_new')}/{live.get('refs_known')}")
    if live.get("rendered") and render:  # what fold rendering did; observe records no folds
        if (live.get("blocks"), live.get("folded")) != (turn.blocks, turn.folded):
            out.append(f"blocks {live.get('blocks')} folded {live.get('folded')}")
        if live.get("executed") != turn.executed:
            out.append(f"ran {','.join(live.get('executed') or []) or '-'}")
    return out


class _System(msgspec.Struct):
    system: list[msgspec.Raw] = []


def _system_head(body: bytes) -> bytes | None:
    """The exact bytes of ``system[0]`` in an Anthropic body."""
    try:
        items = msgspec.json.decode(body, type=_System).system
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return bytes(items[0]) if items else None


def find_flow_files(paths: Iterable[str]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(p.rglob("*.mitm"))
        else:
            out.append(p)
    return out


def replay_file(path: Path, *, first_party: str = "fold", min_compress_chars: int | None = None,
                label: str | None = None, activate: str = "lazy", materialize: str = "cost") -> FileReport:
    from mitmproxy import io
    from mitmproxy.exceptions import FlowReadException

    report = FileReport(label or str(path))
    with tempfile.TemporaryDirectory(prefix="bili-replay-") as tmp:
        rep = Replayer(Path(tmp), first_party=first_party, min_compress_chars=min_compress_chars, activate=activate,
                       materialize=materialize)
        try:
            with open(path, "rb") as f:
                rep.run(report, io.FlowReader(f).stream())
        except (OSError, FlowReadException) as e:
            report.errors.append(f"cannot read {path}: {e}")
        finally:
            rep.close()
    return report


# -- output ---------------------------------------------------------------------------------------------
COLUMNS = ("turn", "lane", "via", "msgs", "refs new/known", "bytes in→out", "~tokens in→out", "blocks", "folded",
           "ran", "reason")


def table(report: FileReport) -> list[str]:
    model = len(report.turns) + report.unidentified
    lines = [f"{report.path}: {report.flows} flows, {model} model requests, {report.other} other flows"]
    sessions: dict[str, list[Turn]] = {}
    for t in report.turns:
        sessions.setdefault(t.session, []).append(t)
    for sid, turns in sessions.items():
        hosts = sorted({t.host for t in turns if t.host})
        lines.append(f"  session {sid}" + (f" ({', '.join(hosts)})" if hosts else ""))
        rows = [COLUMNS]
        for t in turns:
            ran = ",".join(t.executed) or "-"
            if t.called:
                ran += f" (answer calls {','.join(t.called)})"
            note = t.note
            if t.first_party and not note:
                note = ("first-party: system[0] kept first, byte-exact" if t.first_block_kept
                        else "first-party: system[0] CHANGED (a bug: please report)")
            note = "; ".join(x for x in (t.reason, note) if x)
            rows.append((str(t.turn), t.lane, t.via, str(t.messages), f"{t.refs_new}/{t.refs_known}",
                         f"{t.bytes_in}→{t.bytes_out}", f"{t.tokens_in}→{t.tokens_out}", str(t.blocks),
                         str(t.folded), ran, note))
        widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS) - 1)]
        for r in rows:
            lines.append("    " + "  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + ("  " + r[-1] if r[-1] else ""))
    if report.unidentified:
        lines.append(f"  {report.unidentified} model request(s) without a conversation identity (forwarded unchanged)")
    for e in report.errors:
        lines.append(f"  error: {e}")
    return lines


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", metavar="FLOWS", help="mitmproxy flow files (mitmdump -w), or directories "
                                                             "to search for *.mitm")
    p.add_argument("--first-party", choices=FIRST_PARTY, default="fold",
                   help="as the proxy's bili_first_party option (default: fold)")
    p.add_argument("--min-compress-chars", type=int, default=None, metavar="N",
                   help="as the proxy's bili_min_compress_chars option")
    p.add_argument("--activate", choices=("lazy", "always"), default="lazy",
                   help="as the proxy's bili_activate option (default: lazy)")
    p.add_argument("--materialize", choices=("cost", "now"), default="cost",
                   help="as the proxy's bili_materialize option (default: cost)")
    p.add_argument("--json", action="store_true", help="one JSON document: every file's turns")
    p.add_argument("--bodies", metavar="DIR", help="write each upstream body to DIR/<file>-<flow>-<turn>.json")
    p.add_argument("--cost", action="store_true",
                   help="per session, the cost billed under the provider's cache rules with and without the "
                        "addon, and a total")


def run(args: argparse.Namespace) -> int:
    files = find_flow_files(args.paths)
    if not files:
        print("bili: error: no flow files found", file=sys.stderr)
        return 1
    reports = []
    for path in files:
        report = replay_file(path, first_party=args.first_party, min_compress_chars=args.min_compress_chars,
                             activate=args.activate, materialize=args.materialize)
        reports.append(report)
        if args.bodies:
            out = Path(args.bodies)
            out.mkdir(parents=True, exist_ok=True)
            stem = "_".join(path.parts[-3:]).replace(".mitm", "").replace("/", "_")
            for t in report.turns:
                (out / f"{stem}-{t.flow:03d}-{t.session[:12]}-{t.turn}.json").write_bytes(t.body)
        if not args.json and not args.cost:
            print("\n".join(table(report)))
            print(flush=True)
    if args.json:
        print(json.dumps([{"path": r.path, "flows": r.flows, "other": r.other, "unidentified": r.unidentified,
                           "errors": r.errors, "turns": [t.to_json() for t in r.turns]} for r in reports], indent=2))
    if args.cost:
        from bili_addon.replay_cost import cost_table, session_costs

        print("\n".join(cost_table(session_costs(reports))))
    unreadable = [r for r in reports if any(e.startswith("cannot read") for e in r.errors)]
    return 1 if unreadable else 0

"""The mitmproxy addon: options, hooks, fail-open.  The work happens in :mod:`bili_addon.kernel`
(requests) and :mod:`bili_addon.stream` (responses)."""

from __future__ import annotations

import logging
import os
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import msgspec
from mitmproxy import ctx, exceptions, http

from bili_addon import BILI_MODES, FIRST_PARTY, admin, flowmeta, mitmview, prices, printable, private
from bili_addon.kernel import envelope
from bili_addon.kernel.activation import MODES as ACTIVATE
from bili_addon.kernel.calibration import row_dict
from bili_addon.kernel.chains import Turn as ChainTurn, owner_of
from bili_addon.kernel.errors import learn_from_error, request_size
from bili_addon.kernel.fold import FoldConfig
from bili_addon.kernel.nudge import NudgeConfig
from bili_addon.kernel.pending import MODES as MATERIALIZE
from bili_addon.kernel.turn import Engine, TurnResult
from bili_addon.kernel.windows import note_path_model
from bili_addon.keeper import DROPPED, Keeper
from bili_addon import meter
from bili_addon.meter import Meter
from bili_addon.retention import DEFAULT_DAYS, Maintainer
from bili_addon.store import StoreError, default_data_dir
from bili_addon.stores import describe, is_url, open_store, store_spec
from bili_addon.stream import Decoder, ResponseRewriter
from bili_addon.wire import LANES, Lane, detect_lane, is_responses_websocket

log = logging.getLogger("bili")

MODES = BILI_MODES
FIRST_PARTY_HOST = "api.anthropic.com"
BILLING_PREFIX = "x-anthropic-billing-header:"


class _SystemOnly(msgspec.Struct):
    system: msgspec.Raw = msgspec.Raw(b"null")


def first_party_claude(raw: bytes, host: str) -> bool:
    """A Claude Code request to its first-party host: ``system[0]`` is the per-request billing block
    (``x-anthropic-billing-header: ...; cch=...;``), an attestation of the body as the agent sent it."""
    if host.lower().rstrip(".") != FIRST_PARTY_HOST or b"x-anthropic-billing-header" not in raw:
        return False
    try:
        system = msgspec.json.decode(msgspec.json.decode(raw, type=_SystemOnly).system)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
    first = system[0] if isinstance(system, list) and system else None
    return (isinstance(first, dict) and first.get("type") == "text" and isinstance(first.get("text"), str)
            and first["text"].startswith(BILLING_PREFIX))
WS_REFUSAL = b'{"error":"bili: WebSocket upgrades on /responses are refused in fold mode; use HTTP POST"}'


# the options whose values are checked in ``configure``: a choice list, or a lower bound
CHOICES = {"bili_mode": MODES, "bili_first_party": FIRST_PARTY}
NON_NEGATIVE = ("bili_min_compress_chars", "bili_remind_at", "bili_context_window", "bili_retention")


def validate_options(options, updated: set[str]) -> None:
    """Refuse a bad value the way mitmproxy's own addons do: an ``OptionsError`` naming the option,
    the value and what it may be (at start-up mitmdump then exits; at run time the change is undone)."""
    for name, choices in CHOICES.items():
        if name in updated and getattr(options, name) not in choices:
            raise exceptions.OptionsError(
                f"{name}={getattr(options, name)!r} is not one of: {', '.join(choices)}")
    for name in NON_NEGATIVE:
        if name in updated and getattr(options, name) < 0:
            raise exceptions.OptionsError(f"{name}={getattr(options, name)} must be 0 or more")


def check_deferred(options) -> None:
    """``--set`` values given before the addon loaded are applied by mitmproxy right after ``load``; one
    it cannot parse (an option given twice, ``bili_remind_at=abc``) makes it drop the addon without a
    word and forward everything with bili off.  Say so as an error: mitmdump then exits at start-up."""
    known = getattr(options, "_options", {})
    parse = getattr(options, "_parse_setval", None)  # mitmproxy's own parser (private: absent -> no check)
    if parse is None:
        return
    for name, value in list(getattr(options, "deferred", {}).items()):
        values = getattr(value, "val", None)  # the strings of --set, not yet parsed
        if name not in known or not name.startswith("bili_") or values is None:
            continue
        try:
            parse(known[name], list(values))
        except exceptions.OptionsError as e:
            log.error("[bili] %s; mitmproxy would drop the bili addon and forward everything unchanged", e)


def _drop_envelope(flow: http.HTTPFlow) -> None:
    """A body passed on unchanged, without bili's own ``biliMsgIds`` (a host that vouches its message
    ids sends it for bili alone; a provider answers 400 to a field it does not know, and the agent's
    turn would fail because of bili); its header too."""
    req = flow.request
    for name in (envelope.HEADER, envelope.RESYNC_HEADER):
        req.headers.pop(name, None)
    try:
        raw = req.get_content(strict=True)
    except ValueError:  # (a body it cannot decode)
        return
    out = _without_envelope(raw)
    if out is not None:
        req.content = out  # (re-encoded with the request's own content-encoding)


def _without_envelope(raw: bytes | None) -> bytes | None:
    """``raw`` (a JSON object) without its top-level ``biliMsgIds``; None when it has none."""
    if not raw or b'"' + envelope.FIELD.encode() + b'"' not in raw:
        return None
    try:
        top = msgspec.json.decode(raw, type=dict[str, msgspec.Raw])
    except msgspec.DecodeError:  # (ValidationError too: not an object)
        return None
    return msgspec.json.encode(top) if top.pop(envelope.FIELD, None) is not None else None


def _sent(raw: bytes, res: TurnResult | None) -> bytes:
    """The body that goes upstream (the agent's when the turn changed nothing)."""
    return raw if res is None or res.body is None else res.body


@dataclass
class FlowState:
    """What the request side learned about a flow, for its response.  Live objects: kept by the addon
    (weakly keyed by the flow), never in ``flow.metadata``, which mitmproxy serialises; ``record`` is
    the plain record of the flow that is there (:mod:`bili_addon.flowmeta`)."""

    lane: str
    session: str
    rewriter: ResponseRewriter
    record: dict[str, Any] = field(default_factory=dict)
    chain: ChainTurn | None = None  # a Responses turn: its answer goes into the chains transcript
    sent: bytes = b""  # what went upstream: its predicted cache-read share is computed with the answer
    side: bool = False  # a side request (TurnResult.side): its usage is not the conversation's size
    res: Any = None  # the request's TurnResult (its size, should the provider refuse it: kernel/errors.py)


class Bili:
    def __init__(self) -> None:
        self.keeper = Keeper(self._make_engine)  # the engine and its store, off the event loop
        self.retention = Maintainer(self.keeper)  # trimming and pruning, on the store's worker (retention.py)
        self.mode = "fold"
        self.refuse_ws = False
        self.first_party = "fold"
        self.data_dir = ""
        self.store_spec = ""  # bili_store: '' (SQLite in the data dir) or a postgresql:// URL
        self._flows: weakref.WeakKeyDictionary[http.HTTPFlow, FlowState] = weakref.WeakKeyDictionary()
        self.token: str | None = None  # the admin token (``/__bili/`` but health needs it)
        self.token_error: str | None = None  # why there is none (health says it)
        self.meter = Meter()  # the per-request figures and log line (used on the store's worker)

    @property
    def engine(self) -> Engine | None:
        return self.keeper.engine

    def store_status(self) -> dict:
        """What health says about the store: usable or not, and why not."""
        st = self.keeper.status()
        out: dict = {"store": st["ok"], "store_backend": "postgresql" if is_url(self.store_spec) else "sqlite",
                     "store_at": st.get("where") or describe(self.store_spec, self.data_dir)}
        if st.get("latency_ms") is not None:
            out["store_latency_ms"] = st["latency_ms"]
        self.keeper.probe()  # the next health shows a fresh figure (health never waits on the store)
        if "reason" in st:
            out.update(store_error=st["reason"], store_cause=st["cause"], store_hint=st["hint"])
        return out

    # -- options -------------------------------------------------------------------------------
    def load(self, loader) -> None:
        mitmview.register()  # the "bili" content view in mitmproxy and mitmweb
        loader.add_option("bili_data_dir", str, "", "Where the store lives (default: the XDG data dir).")
        loader.add_option(
            "bili_store", str, "",
            "The store: empty for SQLite in bili_data_dir (default; $BILI_STORE when set), or "
            "postgresql://user@host/db for a team gateway (several instances sharing one database).",
        )
        loader.add_option(
            "bili_retention", int, DEFAULT_DAYS,
            "Days a conversation not seen is kept in the store; then its rows are pruned (a tombstone "
            "keeps its ref counter; it would come back cold). 0: forever. Rows nothing reads any more "
            "are trimmed either way.",
        )
        loader.add_option(
            "bili_mode", str, "fold",
            "fold: everything; observe: ledger and stats, body forwarded unchanged; "
            "passthrough: byte-exact forwarding, nothing recorded.",
            choices=MODES,
        )
        loader.add_option(
            "bili_marker", bool, True,
            "Put a one-line [bili] marker in the visible answer when the addon ran a proxy tool for it.",
        )
        loader.add_option(
            "bili_min_compress_chars", int, FoldConfig.min_compress_chars,
            "A compress whose ranges hold fewer characters than this is refused (block-bounded ones excepted).",
        )
        loader.add_option(
            "bili_remind_at", int, NudgeConfig.batch_tokens,
            "Remind the model to fold once this many tokens of older work could be folded (a fold "
            "rewrites the prompt cache after it, so it pays off from a certain size on); 0: only when "
            "the window is nearly full.",
        )
        loader.add_option(
            "bili_activate", str, "lazy",
            "lazy: a session carries no tools, prompt or tags until folding is about to pay (its foldable "
            "work passes bili_remind_at, or half of it when the prompt cache has expired anyway); until "
            "then it is forwarded as the agent sent it. always: from the first request.",
            choices=ACTIVATE,
        )
        loader.add_option(
            "bili_materialize", str, "cost",
            "cost: a compress is executed at once (its result, search and decompress work), but its range "
            "leaves the wire when that pays: at the next moment the prompt cache is cold, when the window "
            "fills, or when the reads it saves outweigh rewriting the cache; held folds land together. "
            "now: every fold leaves the wire with the next request.",
            choices=MATERIALIZE,
        )
        loader.add_option(
            "bili_context_window", int, 0,
            "The context window in tokens for every model (0: from the built-in table, or learned from "
            "the provider's overflow errors).",
        )
        loader.add_option(
            "bili_fold_reconcile", bool, True,
            "Re-anchor fold coverage when the agent re-serialises its history (verified against the "
            "session's own canonical copy); off only for diagnosis.",
        )
        loader.add_option(
            "bili_snapshot_render", bool, False,
            "Render the folded prefix from the session's own transcript instead of the agent's re-sent "
            "bytes (the agent's verbatim tail takes over where its history stops matching).",
        )
        loader.add_option(
            "bili_refuse_websocket", bool, False,
            "In fold mode, answer WebSocket upgrades on /responses with HTTP 426 so the agent "
            "falls back to HTTP with its full history (codex). Off: the WebSocket is kept and its "
            "chained turns are folded like HTTP ones.",
        )
        loader.add_option(
            "bili_first_party", str, "fold",
            "Claude Code's first-party requests to api.anthropic.com (system[0] is its per-request "
            "cch= billing block): fold treats them like any other (that block stays first and byte-exact); "
            "observe records them but forwards their bodies and answers unchanged.",
            choices=FIRST_PARTY,
        )
        check_deferred(loader.master.options)

    def configure(self, updated: set[str]) -> None:
        validate_options(ctx.options, updated)
        if "bili_mode" in updated:
            self.mode = ctx.options.bili_mode
        if "bili_refuse_websocket" in updated:
            self.refuse_ws = ctx.options.bili_refuse_websocket
        if "bili_first_party" in updated:
            self.first_party = ctx.options.bili_first_party
        if "bili_retention" in updated:
            self.retention.days = float(ctx.options.bili_retention)
        if "bili_data_dir" in updated or "bili_store" in updated or not self.data_dir:
            self.data_dir = ctx.options.bili_data_dir or str(default_data_dir())
            self.store_spec = store_spec(ctx.options.bili_store)
            self.keeper.open(self.data_dir)
            self.load_token()
            self.meter.table = prices.load(self.data_dir)
            for err in self.meter.table.errors:
                log.warning("[bili] prices: %s", err)
        elif self.engine is not None:
            self._tune(self.engine)

    def _make_engine(self, data_dir: str) -> Engine:
        """A fresh engine over the store (``bili_store``, else SQLite in ``data_dir``) with the current
        options (raises StoreError)."""
        store = open_store(self.store_spec, data_dir)
        for path in store.tightened:
            log.warning("[bili] %s was readable by other users; now %s", path, "0700" if os.path.isdir(path) else "0600")
        engine = self._tune(Engine(store))
        engine.lineage.defer = True  # a pass's lineage is stored after the answer (_settle), off the request's path
        engine.write_behind = True  # a turn's store write right after its request leaves (Engine.write_pending)
        return engine

    def _tune(self, engine: Engine) -> Engine:
        engine.fold_cfg.min_compress_chars = ctx.options.bili_min_compress_chars
        engine.window = ctx.options.bili_context_window
        remind = ctx.options.bili_remind_at
        never = 1 << 62
        engine.nudge_cfg.batch_tokens = remind if remind > 0 else never
        engine.nudge_cfg.distil_tokens = NudgeConfig.distil_tokens if remind > 0 else never
        engine.reconcile = ctx.options.bili_fold_reconcile
        engine.activate = ctx.options.bili_activate
        engine.materialize = ctx.options.bili_materialize
        engine.snapshot = ctx.options.bili_snapshot_render
        return engine

    def running(self) -> None:
        self.keeper.start()  # from now on the store is used on its worker thread only
        self.retention.start()  # a first trimming and pruning pass, queued behind the store's opening

    def load_token(self) -> str | None:
        """The admin token of the data dir, created on first use; None while it cannot be written."""
        try:
            self.token, self.token_error = private.ensure_token(self.data_dir), None
        except OSError as e:
            self.token = None
            why = str(e) if isinstance(e, private.NotPrivate) else f"cannot write the admin token in {self.data_dir} ({e})"
            if why != self.token_error:  # (an admin request tries again: said once)
                log.warning("[bili] %s; the admin endpoints but health answer 403 until it can be", why)
            self.token_error = why
        return self.token

    def done(self) -> None:
        self.keeper.stop(last=lambda eng: eng.lineage.flush())  # what no answer settled

    @property
    def active(self) -> bool:
        return self.mode != "passthrough"

    # -- requests ------------------------------------------------------------------------------
    def request(self, flow: http.HTTPFlow):
        """Returns an awaitable when the turn's work runs on the store's worker thread (mitmproxy
        awaits it; the event loop serves other flows meanwhile)."""
        if admin.is_admin(flow):
            return admin.handle(flow, self)
        req = flow.request
        if req.headers.get("upgrade", "").lower() == "websocket":
            for name in (envelope.HEADER, envelope.RESYNC_HEADER):  # ours (its frames carry the ids): never forwarded
                req.headers.pop(name, None)
        if not self.active:
            if detect_lane(flow.request.method, flow.request.path) is not None:
                _drop_envelope(flow)  # (bili's own field: a provider refuses a body with it)
            return None
        if (
            self.mode == "fold" and self.refuse_ws and self.keeper.ok and req.method == "GET"
            and req.headers.get("upgrade", "").lower() == "websocket" and is_responses_websocket(req.path)
        ):
            flow.response = http.Response.make(426, WS_REFUSAL, {"content-type": "application/json"})
            log.info("[bili] refused a WebSocket upgrade on %s (426): the agent falls back to HTTP",
                     printable(req.path))
            return
        lane = detect_lane(req.method, req.path)
        if lane is None:
            return
        if flow.is_replay == "request" and flowmeta.read(flow.metadata):
            # mitmproxy sends again a flow bili rewrote (mitmweb's replay, ``mitmdump -C``): its body is
            # what went up then, and goes as it is (made again, it would carry bili's prompt twice and
            # count as a turn of its own)
            log.info("[bili] %s: a replayed flow goes as it was sent", printable(req.path))
            return
        try:
            raw = req.get_content(strict=True)
        except ValueError as e:
            log.warning("[bili] %s: cannot decode request body (%s); forwarding unchanged", printable(req.path),
                        printable(e))
            return
        if not raw:
            return
        fold = self.mode == "fold"
        if fold and self.first_party == "observe" and lane.name == "anthropic" and first_party_claude(raw, req.pretty_host):
            fold = False  # the user asked to leave first-party Claude Code bodies alone
        headers, origin = req.headers.copy(), req.pretty_host
        note_path_model(headers, lane.name, req.path)  # (Gemini's model is in the path, not the body)

        def work(eng: Engine):
            res, turn = self.process_chained(eng, raw, lane, headers, "http", origin, fold)
            return res, self._record(eng, res, lane.name, "http", fold, raw, turn), turn, _sent(raw, res)

        if self.keeper.offloading:
            return self._request_later(flow, lane, fold, work)
        self._apply(flow, lane, fold, self.keeper.run(work))
        return None

    def process_chained(self, eng: Engine, raw: bytes, lane: Lane, headers, where: str, origin: str,
                        fold: bool, conn: str = "") -> tuple[TurnResult | None, ChainTurn | None]:
        """One turn; a Responses body goes through the chains transcript first (kernel/chains.py):
        a delta on a known chain is rebuilt into its whole conversation for the pass, and the pass's
        output becomes the delta or the whole folded input; an unknown chain passes observed.
        ``conn``: the connection key (a WebSocket's; '' for HTTP)."""
        turn = eng.chains.begin(raw, conn, owner_of(origin, headers)) if lane.name == "responses" else None
        if turn is None:
            return self._process(eng, raw, lane, headers, where=where, origin=origin, render=fold), None
        res = self._process(eng, turn.body, lane, headers, where=where, origin=origin,
                            render=fold and turn.known)
        if res is None:  # fail open: the agent's bytes go up
            turn.forwarded()
            return None, turn
        if res.status:
            return res, None
        res.body = turn.outgoing(res.body, rewrite=fold)
        turn.session = res.session or ""
        if turn.prev:
            log.info("[bili] session=%s: chained turn on %s: %s", printable(res.session), printable(turn.prev), {
                "delta": "delta forwarded on the provider's chain",
                "full": "the sent history changed: whole input sent without previous_response_id",
                "passthrough": "chain unknown to the transcript: passed through observed"}.get(turn.mode, turn.mode))
        return res, turn

    async def _request_later(self, flow: http.HTTPFlow, lane: Lane, fold: bool, work) -> None:
        self._apply(flow, lane, fold, await self.keeper.call(work))

    def chain_tap(self, turn: ChainTurn):
        """The rewriter's tap for a chained turn: once the answer's final event is seen (before
        it reaches the agent), its transcript entry is queued on the store's worker, so the
        agent's next request (which may follow at once) finds it."""
        def tap(obj: Any) -> None:
            if turn.finished:
                return
            turn.observe(obj)
            if turn.finished:
                self.keeper.submit(lambda eng: eng.chains.record(turn))
        return tap

    def _apply(self, flow: http.HTTPFlow, lane: Lane, fold: bool, out) -> None:
        """The turn's outcome (the kernel's result and the flow's record) onto the flow (on the event loop)."""
        req = flow.request
        for name in (envelope.HEADER, envelope.RESYNC_HEADER):
            req.headers.pop(name, None)  # ours: never forwarded
        res, record, turn, sent = out or (None, None, None, b"")
        if res is None:  # passed on unchanged (the store down, the session busy, an internal error)
            _drop_envelope(flow)
        if turn is not None and (res is None or not res.session):  # no session: the answer is still chained
            rw = ResponseRewriter(lane.name, False)
            rw.tap = self.chain_tap(turn)
            self._flows[flow] = FlowState(lane.name, "", rw, {}, turn)
        if res is not None and not res.session and res.body is not None:
            req.content = res.body  # only bili's own envelope removed
        if res is None or record is None:
            return
        flow.metadata[flowmeta.KEY] = record
        if res.status:
            flow.response = http.Response.make(
                res.status, msgspec.json.encode({"error": {"type": "bili_message_ids", "message": res.error}}),
                {"content-type": "application/json"},
            )
            log.warning("[bili] session=%s: %s (answered %d)", printable(res.session), printable(res.error), res.status)
            return
        if res.body is not None:
            req.content = res.body  # re-encoded with the request's own content-encoding
        rewrite = fold and res.active  # an inactive session offered no tools: its answers are the agent's
        if rewrite:
            # a compressed stream cannot be filtered event by event
            req.headers["accept-encoding"] = "identity"
        marker = res.marker if ctx.options.bili_marker else ""
        rw = ResponseRewriter(lane.name, rewrite, marker)
        rw.lane.shadowed = res.shadowed
        self._note_native(rw, res.session)
        if turn is not None:
            rw.tap = self.chain_tap(turn)
        self._flows[flow] = FlowState(lane.name, res.session, rw, record, turn, sent, res.side, res)

    def _note_native(self, rw: ResponseRewriter, session: str) -> None:
        """The answer's calls of bili's tools under the agent's own names for them (its MCP server's)
        noted with its conversation: ``bili mcp`` started without one runs them there (kernel/native.py)."""
        eng = self.engine
        if eng is not None and session:
            rw.lane.on_native = lambda name, args, cid: eng.native.note(session, name, args, cid)

    def _record(self, eng: Engine, res: TurnResult | None, lane: str, via: str, rendered: bool,
                raw: bytes, turn: ChainTurn | None = None) -> dict[str, Any] | None:
        """The flow's plain record of a turn (on the worker: it reads the session's blocks)."""
        if res is None or not res.session:
            return None
        s = eng.sessions.get(res.session)
        sent = raw if res.body is None else res.body
        rec = flowmeta.request_record(res, mode=self.mode, rendered=rendered, lane=lane, via=via, raw=raw,
                                      sent=sent, blocks=s.blocks if s else [])
        if s is not None:
            if turn is not None and turn.full_sent is not None:
                # a chained turn: the prompt is the whole chain, the agent's and the one bili keeps
                rec.update(self.meter.request(s, turn.body, turn.full_sent, res.model))
            else:  # (priced by its model and the window it asked for: prices.may_go_long)
                rec.update(self.meter.request(s, raw, sent, res.model + res.variant if res.model else ""))
        return rec

    def _process(self, eng: Engine, raw: bytes, lane: Lane, headers, where: str, origin: str = "",
                 render: bool | None = None) -> TurnResult | None:
        """One turn through the engine (on the store's worker thread); a store failure propagates
        to the keeper, anything else fails open here."""
        t0 = time.perf_counter()
        try:
            res = eng.process(raw, lane, headers, render=self.mode == "fold" if render is None else render,
                              origin=origin)
        except (msgspec.DecodeError, ValueError) as e:
            log.info("[bili] %s %s: body not understood (%s); forwarding unchanged", lane.name, where, printable(e))
            return None
        except StoreError:
            raise
        except Exception as e:  # fail open: the agent's turn never fails because of us
            log.exception("[bili] internal error on %s %s: %s; forwarding unchanged", lane.name, where, printable(e))
            return None
        ms = (time.perf_counter() - t0) * 1000
        if not res.session:
            log.info("[bili] lane=%s %s msgs=%d: %s; forwarding unchanged", lane.name, where, res.messages, res.source)
            return res
        for note in res.notes:
            log.warning("[bili] session=%s: %s", printable(res.session), printable(note))
        out = len(res.body) if res.body is not None else len(raw)
        s = eng.sessions.get(res.session)
        folded = ""
        if s is not None and s.blocks:
            folded = (f" blocks={sum(b.active for b in s.blocks)} folded={res.folded_items} "
                      f"sent ~{s.sent_tokens} tokens instead of ~{s.unfolded_tokens}")
        ran = f" ran={','.join(res.executed)}" if res.executed else ""
        log.info(
            "[bili] session=%s lane=%s msgs=%d refs new=%d known=%d tagged=%d%s%s bytes in=%d out=%d addon=%.1fms",
            printable(res.session), lane.name, res.messages, res.refs_new, res.refs_known, res.tagged, folded, ran,
            len(raw), out, ms,
        )
        return res

    # -- responses -----------------------------------------------------------------------------
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        st = self._flows.get(flow)
        resp = flow.response
        if resp is None or "text/event-stream" not in resp.headers.get("content-type", ""):
            return  # a JSON body is handled whole in ``response``
        if st is None:
            # a stream bili does not read (a body it passed on unchanged, passthrough, not a model's):
            # streamed as it comes; mitmproxy would hold it until its end (an agent sees nothing before)
            if resp.stream is False:
                resp.stream = True
            return
        if not 200 <= resp.status_code < 300:
            return
        decoder = None
        enc = resp.headers.get("content-encoding", "").strip().lower()
        if enc and enc != "identity":
            try:
                decoder = Decoder(enc)
            except ValueError:
                log.warning("[bili] session=%s: stream encoded as %s; passing it untouched", printable(st.session),
                            printable(repr(enc)))
                resp.stream = True  # (as it comes, not held to its end)
                return
        if st.rewriter.rewrite or decoder is not None:
            resp.headers.pop("content-length", None)
            if decoder is not None:
                resp.headers.pop("content-encoding", None)
        resp.stream = st.rewriter.stream(decoder)

    def response(self, flow: http.HTTPFlow):
        """The answer's bookkeeping runs on the store's worker; mitmproxy awaits it, so an answer
        leaves only once the proxy calls it made are recorded (another process may take the next turn)."""
        st = self._flows.pop(flow, None)
        resp = flow.response
        if st is None or resp is None:
            return None
        status, error = resp.status_code, b""
        try:
            if status >= 400:
                error = resp.get_content(strict=False) or b""
            elif not resp.stream and "json" in resp.headers.get("content-type", ""):
                content = resp.get_content(strict=False)
                if content:
                    out = st.rewriter.json_body(content)
                    if out is not None:
                        resp.content = out
        except Exception as e:
            log.exception("[bili] session=%s: response handling failed (%s); answer left as is", printable(st.session),
                          printable(e))
            return None

        if not st.session:
            return None  # a chained turn without a session: its tap did all there is to do

        def job(eng: Engine) -> None:
            try:
                # (as a replay does: kernel/errors.py)
                learn_from_error(eng, st.session, status, error, request_size(st.res) if status >= 400 else 0, st.side)
                self._account(eng, st)
            except StoreError:
                raise
            except Exception as e:
                log.exception("[bili] session=%s: response handling failed (%s); answer left as is",
                              printable(st.session), printable(e))

        if self.keeper.offloading:
            return self.keeper.call(job, DROPPED)
        self.keeper.run(job, DROPPED)
        return None

    def error(self, flow: http.HTTPFlow) -> None:
        st = self._flows.pop(flow, None)  # no answer comes; mitmweb keeps the flow, not our state
        if st is not None:
            self.keeper.submit(lambda eng: self._settle(eng, st.session))

    @staticmethod
    def _settle(eng: Engine, sid: str) -> None:
        """The lineage the request kept back (fingerprints of its new parts), stored now that the
        answer is in: off the request's path, before the agent can fork from it.  A failure costs
        the family, never the answer."""
        try:
            eng.lineage.flush(sid)
        except Exception as e:
            log.warning("[bili] session=%s: lineage not stored (%s: %s); a fork of this turn may not be "
                        "recognised", printable(sid), type(e).__name__, printable(e))

    def _account(self, eng: Engine, st: FlowState) -> None:
        # the lineage, usage, cache observation and wire figures: one statement on PostgreSQL
        with eng.store.answer():
            self._settle(eng, st.session)
            self._answer_records(eng, st)

    def _answer_records(self, eng: Engine, st: FlowState) -> None:
        """What the answer leaves: the calls it made, its usage and cost, the log line."""
        if st.sent and "agent_tokens" in st.record:  # the request's predicted cache-read share, off its path
            # a chained turn's prompt is the whole chain the provider holds, not the delta that went up
            whole = st.chain.prompt() if st.chain is not None else None
            st.record["predicted"] = self.meter.predict(st.session, whole or st.sent, st.side)
            st.sent = b""
        self.retention.answered()  # counts; a due pass is queued on the worker, after this answer's work
        rw = st.rewriter
        called = eng.record_answer(st.session, st.lane, rw, st.side)
        flowmeta.record_answer(st.record, rw, called)
        if called:
            log.info("[bili] session=%s: the model called %s; it runs when the agent's next request carries it",
                     printable(st.session), ", ".join(called))
        if rw.stripped:
            log.info("[bili] session=%s: stripped %d tag echo(es) from the model's prose", printable(st.session),
                     rw.stripped)
        u = rw.usage
        if not u.seen:
            return
        share = f"{100 * u.cache_share:.0f}%" if u.cache_share is not None else "n/a"
        log.debug(
            "[bili] session=%s usage input=%d cache_read=%d cache_write=%d output=%d cache-read share=%s",
            printable(st.session), u.input, u.cache_read, u.cache_write, u.output, share,
        )
        if "agent_tokens" not in st.record:
            return
        w = self.meter.row(st.record, u)
        w.side = st.side  # (a title request's figures are not the conversation's "now")
        w.n = eng.store.record_wire(st.session, w)
        log.info("%s", printable(self.meter.line(st.session, st.lane, str(st.record.get("agent") or ""), w)))

    # -- WebSocket (Responses) -----------------------------------------------------------------
    def websocket_message(self, flow: http.HTTPFlow):
        """Codex's transport: one ``response.create`` frame per turn (the new items, chained by
        ``previous_response_id`` to a response of this connection), one event per server frame.
        A client frame goes through the chains transcript like an HTTP body (the delta as the agent
        sent it, or the whole folded input when a fold landed); the connection key is the flow's,
        since mitmproxy gives each agent connection an upstream connection of its own.  Server
        frames are rewritten as the HTTP stream is and feed the transcript.  Fail open per frame."""
        if flow.websocket is None or not is_responses_websocket(flow.request.path):
            return None
        msg = flow.websocket.messages[-1]
        if not msg.is_text:
            return None
        if not self.active:  # (passthrough: the frame as it came, without bili's own field, as over HTTP)
            if msg.from_client:
                msg.content = _without_envelope(msg.content) or msg.content
            return None
        if msg.from_client:
            if b'"response.create"' not in msg.content:
                return None
            raw, headers, origin = msg.content, flow.request.headers.copy(), flow.request.pretty_host
            fold, conn = self.mode == "fold", flow.id
            self._flows.pop(flow, None)  # a new turn: the previous answer's state is done with

            def work(eng: Engine):
                res, turn = self.process_chained(eng, raw, LANES["responses"], headers, "ws", origin, fold, conn)
                return res, self._record(eng, res, "responses", "ws", fold, raw, turn), turn, _sent(raw, res)

            if self.keeper.offloading:
                return self._ws_later(flow, msg, work)
            self._ws_apply(flow, msg, self.keeper.run(work))
            return None
        st = self._flows.get(flow)
        if st is None:
            return None
        try:
            frame = st.rewriter.ws_frame(msg.content)
            if frame is not None:
                msg.content = frame
            if st.rewriter.finished:  # once per answer, whichever final event ends it
                if st.session:
                    self.keeper.submit(lambda eng: self._account(eng, st))
                self._flows.pop(flow, None)
        except Exception as e:
            log.exception("[bili] session=%s: WebSocket frame handling failed (%s); frame left as is",
                          printable(st.session), printable(e))
        return None

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        st = self._flows.pop(flow, None)
        if st is not None:
            self.keeper.submit(lambda eng: self._settle(eng, st.session))
        if self.active and is_responses_websocket(flow.request.path):
            conn = flow.id  # after any answer's transcript entry queued before it
            self.keeper.submit(lambda eng: eng.chains.end(conn))

    async def _ws_later(self, flow: http.HTTPFlow, msg, work) -> None:
        self._ws_apply(flow, msg, await self.keeper.call(work))

    def _ws_apply(self, flow: http.HTTPFlow, msg, out) -> None:
        """The turn's outcome onto the client frame (on the event loop); any failure leaves the
        frame as the agent sent it."""
        try:
            res, record, turn, sent = out or (None, None, None, b"")
            if res is None or res.status:  # the frame goes as the agent sent it, but never with bili's own envelope
                msg.content = _without_envelope(msg.content) or msg.content
            if res is not None and res.status:
                log.warning("[bili] session=%s: %s (WebSocket frame forwarded unchanged)", printable(res.session),
                            printable(res.error))
                return
            if res is not None and res.body is not None:
                msg.content = res.body  # the delta (tags, a reminder), the whole folded input, or no envelope
            session = res.session if res is not None else ""
            rewrite = self.mode == "fold" and res is not None and bool(res.session) and res.active
            marker = res.marker if rewrite and ctx.options.bili_marker else ""
            rw = ResponseRewriter("responses", rewrite, marker)
            if res is not None:
                rw.lane.shadowed = res.shadowed
                self._note_native(rw, res.session)
            if turn is not None:
                rw.tap = self.chain_tap(turn)  # the answer goes into the chains transcript
            if record is not None:
                record["message"] = len(flow.websocket.messages) - 1
                flow.metadata.setdefault(flowmeta.WS_KEY, []).append(record)
            if session or turn is not None:
                self._flows[flow] = FlowState("responses", session, rw, record or {}, turn, sent,
                                              res is not None and res.side, res)
        except Exception as e:  # fail open: this frame goes up as the agent sent it
            log.exception("[bili] WebSocket frame handling failed (%s); frame forwarded unchanged", printable(e))

    # -- admin ---------------------------------------------------------------------------------
    def stats(self, eng: Engine | None = None, only: str | None = None) -> dict:
        """Per-session figures (on the store's worker: see :func:`admin.handle`); ``only``: that session's
        alone (the page polls one session's every two seconds: the figures of every session, some ten
        reads each, held the worker, and every agent's turn waited behind them)."""
        eng = eng or self.engine
        if eng is None:
            return {"sessions": [], "store": False, "store_status": self.keeper.status()}
        store = eng.store
        sessions = []
        families = self.engine.lineage.families()
        rows = store.sessions()
        if only is not None:
            rows = [r for r in rows if r.id == only]
        for r in rows:
            u = store.usage(r.id)
            flags = msgspec.json.decode(r.flags or "{}")
            entry = {
                "id": r.id, "agent": r.agent, "lane": r.lane, "requests": r.requests,
                "messages": r.messages, "refs": store.ref_count(r.id), "last_seen": r.last_seen,
                "usage": {
                    "turns": u.turns, "input_tokens": u.input_tokens, "cache_read": u.cache_read,
                    "cache_write": u.cache_write, "output_tokens": u.output_tokens,
                    "cache_read_share": round(u.cache_read / u.input_tokens, 4) if u.input_tokens else None,
                    "last_turn_cache_read_share": (
                        round(u.last[1] / u.last[0], 4) if u.last and u.last[0] else None
                    ),
                },
                "flags": flags,
            }
            live = eng.sessions.get(r.id)
            blocks = live.blocks if live is not None else []
            entry["fold"] = {
                "paused": bool(live is not None and live.copy.latched),
                "blocks": sum(b.active for b in blocks),
                "blocks_total": len(blocks),
                "tokens_folded": sum(b.folded_tokens for b in blocks if b.active),
                "blocks_retired": sum(b.retired for b in blocks),  # from before the agent's compactions
                # the session's epochs: each compaction of the agent's own starts one (kernel/compaction.py)
                "epoch": len(flags.get("epochs", [])) + 1,
                "epochs": [{k: e.get(k) for k in ("epoch", "agent", "marker", "request", "retired_blocks")}
                           for e in flags.get("epochs", [])],
                "sent_tokens": live.sent_tokens if live is not None else None,
                "unfolded_tokens": live.unfolded_tokens if live is not None else None,
            }
            # lazy activation (kernel/activation.py): why bili shows itself in this session, or null
            entry["active"] = flags.get("active") or ("always" if eng.activate == "always" else None)
            # the provider cache model of this process: predicted vs reported cache reads per request,
            # and what the reports taught (a shorter lifetime, no cache)
            entry["cache"] = eng.clocks.stats(r.id)
            # the same, stored per answered request (survives restarts): totals, agreement, what was learned
            # for the session and what is in force (its own facts, its host's, or the documented rules)
            entry["calibration"] = eng.calibration.summary(r.id)
            # the cache lifetime decision (kernel/lifetime.py): 5m or 1h, with the expected costs per request
            entry["lifetime"] = flags.get("ttl")
            # held folds (kernel/pending.py): made, not yet off the wire, and the last decision on them
            held = flags.get("pending") or {}
            entry["held"] = {"blocks": held.get("blocks", []), "decision": held.get("last")} if held else None
            family = families.get(r.id)
            if family is not None:  # forks: {root, parent, fork_at, children}
                entry["lineage"] = family
            entry["wire"] = meter.totals(store, r.id, self.meter.table)
            if flags.get("delta_history"):
                entry["warning"] = ("a previous_response_id chain the transcript does not hold (it began before "
                                    "bili saw it): observed until the agent sends its whole history")
            sessions.append(entry)
        return {"sessions": sessions, "store": True, "store_status": self.keeper.status(),
                # trimming and pruning (retention.py): the days kept, the passes made, the last one's figures
                "retention": {"days": self.retention.days, "passes": self.retention.passes,
                              "last": self.retention.last},
                "prices": {"as_of": self.meter.table.as_of, "source": self.meter.table.source},
                # what each host's cache reports taught (kernel/calibration.py), shared by its sessions
                "hosts": eng.calibration.host_facts()}

    def session_turns(self, eng: Engine, sid: str) -> dict | None:
        """One session's answered turns (``/__bili/stats?session=ID``); None: no such session."""
        if eng.store.session(sid) is None:
            return None
        return {"id": sid, "turns": [meter.turn_dict(w, self.meter.table) for w in eng.store.wire(sid)],
                "calibration": [row_dict(r) for r in eng.store.calibration(sid)]}

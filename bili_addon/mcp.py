"""``bili mcp``: bili's four tools as a stdio MCP server.

The agent starts this process and speaks JSON-RPC 2.0 to it, one JSON message per line on
stdin/stdout (the MCP stdio transport).  Tool calls are forwarded to the running proxy's
``POST /__bili/plugin/tool``; the conversation state lives there, not here.  Nothing but protocol
messages is ever written to stdout: logs go to stderr.

Only the small subset of MCP a tools-only server needs: ``initialize``, ``ping``, ``tools/list``,
``tools/call`` and the notifications a client sends.  No dependency beyond the standard library
(and bili's own tool schemas), so it starts fast and never imports mitmproxy.

    python -m bili_addon.mcp [--proxy URL] [--conversation ID] [--data-dir DIR]

Every call carries the install's admin token (read from ``<data dir>/admin-token``, or
``$BILI_TOKEN``): the proxy answers nobody else.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import IO, Any

from bili_addon import DEFAULT_HOST, DEFAULT_PORT, __version__, adminclient, default_proxy, private
from bili_addon.kernel.prompts import TOOLS

log = logging.getLogger("bili.mcp")

PROTOCOL_VERSIONS = ("2025-06-18", "2025-03-26", "2024-11-05")
LATEST_PROTOCOL = PROTOCOL_VERSIONS[0]
DEFAULT_PROXY = f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"
TOOL_PATH = "/__bili/plugin/tool"
DEFAULT_TIMEOUT = 60.0

# JSON-RPC 2.0 error codes
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603

INSTRUCTIONS = (
    "bili keeps this conversation within its context window. The proxy tags every message with a "
    "ref (<acp ...>m00042</acp>); compress folds consumed ranges of refs into your summaries, "
    "decompress and search_context bring folded content back, acp_status shows usage and what can "
    "be folded."
)


class RpcError(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def normalize_proxy(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url


def tool_list() -> list[dict[str, Any]]:
    return [{"name": t["name"], "description": t["description"], "inputSchema": t["parameters"]} for t in TOOLS]


class Server:
    """The protocol state machine: one parsed message in, at most one reply out."""

    def __init__(self, proxy: str = DEFAULT_PROXY, conversation: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT, token: str | None = None, token_source: str = ""):
        self.proxy = normalize_proxy(proxy)
        self.token = token
        self.token_source = token_source  # where the token came from, for the model's error message
        self.conversation = conversation or None
        self.timeout = timeout
        self.tools = tool_list()
        self.names = {t["name"] for t in self.tools}

    # -- dispatch ------------------------------------------------------------------------------
    def handle_line(self, line: bytes | str) -> Any:
        """One line of the transport: the reply to write (a dict or a list), or None."""
        try:
            msg = json.loads(line)
        except (ValueError, RecursionError) as e:  # (RecursionError: nested past the parser's depth)
            return _error(None, PARSE_ERROR, f"Parse error: {type(e).__name__}: {e}")
        if isinstance(msg, list):  # a batch (MCP 2025-03-26)
            if not msg:
                return _error(None, INVALID_REQUEST, "Invalid Request: empty batch")
            replies = [r for r in (self.handle(m) for m in msg) if r is not None]
            return replies or None
        return self.handle(msg)

    def handle(self, msg: Any) -> dict[str, Any] | None:
        if not isinstance(msg, dict):
            return _error(None, INVALID_REQUEST, "Invalid Request: not a JSON object")
        method = msg.get("method")
        has_id = "id" in msg
        mid = msg.get("id")
        if method is None and has_id and ("result" in msg or "error" in msg):
            return None  # a reply to a request of ours; we send none
        echo = mid if _valid_id(mid) else None
        if not isinstance(method, str):
            return _error(echo, INVALID_REQUEST, "Invalid Request: no method")
        if not has_id:  # a notification (initialized, cancelled, ...): never answered
            return None
        if msg.get("jsonrpc") != "2.0":
            return _error(echo, INVALID_REQUEST, 'Invalid Request: jsonrpc must be "2.0"')
        if not _valid_id(mid):
            return _error(None, INVALID_REQUEST, "Invalid Request: id must be a string or a number")
        params = msg.get("params")
        if params is None:
            params = {}
        try:
            if not isinstance(params, dict):
                raise RpcError(INVALID_PARAMS, "Invalid params: expected an object")
            return {"jsonrpc": "2.0", "id": mid, "result": self.dispatch(method, params)}
        except RpcError as e:
            return _error(mid, e.code, e.message)
        except Exception as e:  # a bug here must not kill the agent's MCP session
            log.exception("bili mcp: %s failed", method)
            return _error(mid, INTERNAL_ERROR, f"Internal error: {type(e).__name__}: {e}")

    def dispatch(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        if method == "initialize":
            return self.initialize(params)
        if method == "ping":
            return {}
        if method == "tools/list":
            return {"tools": self.tools}
        if method == "tools/call":
            return self.tools_call(params)
        raise RpcError(METHOD_NOT_FOUND, f"Method not found: {method}")

    # -- methods -------------------------------------------------------------------------------
    def initialize(self, params: dict[str, Any]) -> dict[str, Any]:
        asked = params.get("protocolVersion")
        version = asked if asked in PROTOCOL_VERSIONS else LATEST_PROTOCOL
        info = params.get("clientInfo") if isinstance(params.get("clientInfo"), dict) else {}
        client = " ".join(str(info[k]) for k in ("name", "version") if info.get(k)) or "a client"
        log.info("bili mcp: %s connected (protocol %s), proxy %s", client, version, self.proxy)
        return {
            "protocolVersion": version,
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "bili", "version": __version__},
            "instructions": INSTRUCTIONS,
        }

    def tools_call(self, params: dict[str, Any]) -> dict[str, Any]:
        name = params.get("name")
        if not isinstance(name, str) or name not in self.names:
            raise RpcError(INVALID_PARAMS, f"Unknown tool: {name!r} (bili has {', '.join(sorted(self.names))})")
        args = params.get("arguments")
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise RpcError(INVALID_PARAMS, "Invalid params: arguments must be an object")
        ok, text = self.call_proxy(name, args)
        return {"content": [{"type": "text", "text": text}], "isError": not ok}

    def call_proxy(self, tool: str, args: dict[str, Any]) -> tuple[bool, str]:
        """``(ok, text)``: the tool's result, or why it could not run (said to the model)."""
        body = {"conversationId": self.conversation, "tool": tool, "args": args}
        try:
            got = adminclient.call(self.proxy, TOOL_PATH, method="POST", body=body, token=self.token,
                                   timeout=self.timeout)
        except adminclient.Unreachable as e:
            log.warning("bili mcp: %s: the proxy at %s is not reachable: %s", tool, self.proxy, e.reason)
            return False, (f"{tool} did not run: the bili proxy at {self.proxy} is not reachable: {e.reason}. "
                           "Is `bili run` running? Point `bili mcp` at it with --proxy or BILI_PROXY.")
        status, raw, doc = got.status, got.raw, got.doc
        if not isinstance(doc, dict):
            snippet = raw[:200].decode("utf-8", "replace")
            return False, f"{tool} did not run: {self.proxy} answered HTTP {status}, not bili: {snippet!r}"
        if status == 200 and doc.get("ok") is True and isinstance(doc.get("result"), str):
            return True, doc["result"]
        error = doc.get("error") if isinstance(doc.get("error"), str) else f"unexpected answer {doc!r}"
        log.warning("bili mcp: %s: HTTP %s: %s", tool, status, error)
        if status == 404 and error.startswith("no such bili endpoint"):
            return False, (f"{tool} did not run: the proxy at {self.proxy} has no {TOOL_PATH} endpoint "
                           "(an older bili version?)")
        if status == 403:
            where = self.token_source or "no admin token found"
            return False, (f"{tool} did not run: the bili proxy at {self.proxy} refused it: {error} "
                           f"(bili mcp's token: {where}; if the proxy runs with --data-dir, give bili mcp "
                           "the same --data-dir)")
        return False, f"{tool} did not run: {error} (HTTP {status} from the bili proxy at {self.proxy})"


def find_token(data_dir: str | None, env) -> tuple[str | None, str]:
    """``(token, where it came from)``: ``$BILI_TOKEN``, else the token file in ``data_dir``
    (``$BILI_DATA_DIR``, else the default data dir)."""
    if env.get("BILI_TOKEN"):
        return env["BILI_TOKEN"].strip(), "$BILI_TOKEN"
    if data_dir or env.get("BILI_DATA_DIR"):
        base = os.path.expanduser(data_dir or env["BILI_DATA_DIR"])
    else:
        from bili_addon.store import default_data_dir

        base = str(default_data_dir(env))
    path = os.path.join(base, private.TOKEN_FILE)
    token = private.read_token(base)
    if token is None and (why := private.refusal(base)):
        return None, f"the admin token in {base} is not used: {why}"
    return token, path if token else f"no admin token in {path} (has the proxy run with this data dir?)"


def _valid_id(mid: Any) -> bool:
    return isinstance(mid, str) or (isinstance(mid, int) and not isinstance(mid, bool))


def _error(mid: Any, code: int, message: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": mid, "error": {"code": code, "message": message}}


# -- the stdio transport -------------------------------------------------------------------------------
def serve(server: Server, stdin: IO[bytes], stdout: IO[bytes]) -> int:
    """Read newline-delimited messages until EOF, answering each in order."""
    for line in stdin:
        if not line.strip():
            continue
        try:
            reply = server.handle_line(line)
        except Exception as e:  # one message's failure is its reply, never the server's end
            reply = _error(None, INTERNAL_ERROR, f"Internal error: {type(e).__name__}: {e}")
        if reply is None:
            continue
        # (ASCII escapes: a lone surrogate the client sent, echoed in an id, is no UTF-8)
        stdout.write(json.dumps(reply, separators=(",", ":")).encode() + b"\n")
        stdout.flush()
    return 0


# -- command line (``bili mcp`` and ``python -m bili_addon.mcp``) ---------------------------------------
def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--proxy", metavar="URL", default=None,
                   help=f"the running bili proxy (default: $BILI_PROXY, else {DEFAULT_HOST}:$BILI_PORT, "
                        f"else {DEFAULT_PROXY})")
    p.add_argument("--conversation", metavar="ID", default=None,
                   help="the conversation the tools act on (default: $BILI_CONVERSATION_ID, else the "
                        "conversation whose answer made the call, as the proxy read it)")
    p.add_argument("--data-dir", metavar="DIR", default=None,
                   help="the proxy's data directory, where its admin token is (default: $BILI_DATA_DIR, "
                        "else $XDG_DATA_HOME/bili-addon); $BILI_TOKEN overrides the token")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                   help=f"how long one tool call may take (default: {DEFAULT_TIMEOUT:g})")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
    proxy = args.proxy or default_proxy()
    conversation = args.conversation or os.environ.get("BILI_CONVERSATION_ID") or None
    token, source = find_token(getattr(args, "data_dir", None), os.environ)
    if token is None:
        log.warning("bili mcp: %s; the proxy will refuse the calls", source)
    server = Server(proxy, conversation, args.timeout, token, source)
    stdout = sys.stdout.buffer
    sys.stdout = sys.stderr  # a stray print must never corrupt the protocol stream
    log.info("bili mcp %s: tools served over stdio, calls go to %s%s", __version__, server.proxy,
             f" for conversation {conversation}" if conversation else "")
    try:
        return serve(server, sys.stdin.buffer, stdout)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # the client went away
        return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bili mcp", description="bili's tools as a stdio MCP server")
    configure(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

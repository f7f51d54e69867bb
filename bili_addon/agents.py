"""What the launcher knows about each agent: its binary, how it trusts a CA, which proxy variables it
honours, its built-in model hosts and where its own configuration names custom base URLs.

Configuration files are only ever **read** here (opened read-only, never created, never written).
A base URL found in them adds its host to the hosts the proxy intercepts; everything else the agent
talks to is tunnelled through the proxy without decryption.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping
from urllib.parse import urlsplit

NODE_CA = "NODE_EXTRA_CA_CERTS"  # added to Node's/Bun's built-in roots
BUNDLE_CA = "SSL_CERT_FILE"  # one bundle instead of the system roots (Rust, Python)
ANY_CA = "any"  # a program bili does not know (bili run --transparent): both of the above
CODEX_CA = "CODEX_CA_CERTIFICATE"  # codex's own bundle, read before SSL_CERT_FILE (codex-client's custom_ca.rs)

# model API hosts of the providers the agents ship with (HTTPS, port 443)
ANTHROPIC = "api.anthropic.com"
OPENAI = "api.openai.com"
CHATGPT = "chatgpt.com"  # codex and pi with a ChatGPT login: /backend-api/codex/responses
GEMINI = "generativelanguage.googleapis.com"
OPENROUTER = "openrouter.ai"
OTHER_PROVIDERS = (
    "api.x.ai",
    "api.groq.com",
    "api.mistral.ai",
    "api.deepseek.com",
    "api.cerebras.ai",
    "api.together.xyz",
    "api.fireworks.ai",
    "api.moonshot.ai",
    "api.z.ai",
    "api.githubcopilot.com",
    "inference-api.nousresearch.com",
    "opencode.ai",  # opencode zen: https://opencode.ai/zen/v1
)

# keys under which agents keep a provider's base URL, in any nesting
_BASE_URL_KEYS = frozenset({"baseurl", "base_url", "api_base", "apibase", "api_base_url", "anthropic_base_url",
                            "openai_base_url"})
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)|\{env:([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True)
class Endpoint:
    """A base URL an agent is configured with, and where it was found."""

    url: str
    source: str

    @property
    def scheme(self) -> str:
        return urlsplit(self.url).scheme.lower()

    @property
    def host(self) -> str:
        return (urlsplit(self.url).hostname or "").lower()

    @property
    def port(self) -> int:
        parts = urlsplit(self.url)
        try:
            port = parts.port
        except ValueError:
            port = None
        return port or (443 if parts.scheme.lower() == "https" else 80)

    @property
    def loopback(self) -> bool:
        h = self.host
        if h == "localhost" or h.endswith(".localhost"):
            return True
        try:
            return ipaddress.ip_address(h).is_loopback
        except ValueError:
            return False


@dataclass
class HostPlan:
    """The hosts the proxy should intercept for an agent, and what could not be intercepted."""

    hosts: list[tuple[str, int]] = field(default_factory=list)  # (host, port), in order, no duplicates
    endpoints: list[Endpoint] = field(default_factory=list)  # custom base URLs found
    notes: list[str] = field(default_factory=list)  # base URLs HTTPS_PROXY cannot reach, unreadable files

    def add(self, host: str, port: int = 443) -> None:
        key = (host.lower(), port)
        if host and key not in self.hosts:
            self.hosts.append(key)


@dataclass(frozen=True)
class Agent:
    name: str  # the launcher subcommand: bili <name>
    title: str
    binary: str
    ca_var: str  # NODE_CA or BUNDLE_CA
    builtin_hosts: tuple[str, ...]
    config_files: Callable[[Mapping[str, str], Path], list[Path]]
    env_base_urls: tuple[str, ...] = ()  # environment variables naming a base URL
    proxy_vars: tuple[str, ...] = ()  # more variables to set to the proxy URL (omp: PI_PROXY)
    bundle_vars: tuple[str, ...] = ()  # more variables to set to the CA bundle (codex: CODEX_CA)
    env_table: bool = False  # its settings' "env" table is applied over its environment (Claude Code)
    package: str = ""  # where it comes from: npm:<name> or pypi:<name>
    tested_version: str = ""
    mcp: bool = False  # takes MCP servers (bili mcp)
    daemons: tuple[str, ...] = ()  # subcommands of background servers it may hand work to (codex app-server)

    def model_hosts(self, env: Mapping[str, str], cwd: Path | None = None) -> HostPlan:
        """Built-in model hosts plus the hosts of every base URL in the agent's configuration."""
        plan = HostPlan()
        for h in self.builtin_hosts:
            plan.add(h)
        for ep in self.endpoints(env, cwd or Path.cwd(), plan.notes):
            plan.endpoints.append(ep)
            if ep.scheme == "https" and ep.host:
                plan.add(ep.host, ep.port)
            elif ep.scheme == "http" and ep.host:
                hint = ("run 'bili run --mode reverse:<real upstream> --listen-port N' and point that base URL "
                        "at http://127.0.0.1:N instead" if ep.loopback else
                        "plain-HTTP traffic is not sent through HTTPS_PROXY")
                plan.notes.append(f"{ep.url} (from {ep.source}) is plain http://, so bili cannot intercept it "
                                  f"through HTTPS_PROXY; {hint}")
        return plan

    def endpoints(self, env: Mapping[str, str], cwd: Path, notes: list[str] | None = None) -> list[Endpoint]:
        out: list[Endpoint] = []
        for var in self.env_base_urls:
            value = env.get(var, "").strip()
            if value:
                out.append(Endpoint(value, f"${var}"))
        for path in self.config_files(env, cwd):
            try:
                data = load_config(path)
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as e:
                if notes is not None:
                    notes.append(f"cannot read {path}: {e}")
                continue
            for url in base_urls(data, env):
                out.append(Endpoint(url, str(path)))
        seen: set[str] = set()
        unique = []
        for ep in out:
            if ep.url not in seen:
                seen.add(ep.url)
                unique.append(ep)
        return unique


# -- reading configuration (read-only) --------------------------------------------------------------
def load_config(path: Path) -> Any:
    """Parse a JSON/JSONC, TOML or YAML file by its extension.  Opens the file read-only."""
    with open(path, "rb") as f:
        raw = f.read()
    suffix = path.suffix.lower()
    if suffix == ".toml":
        return tomllib.loads(raw.decode("utf-8"))
    if suffix in (".yml", ".yaml"):
        try:
            from ruamel.yaml import YAML  # mitmproxy's own YAML dependency
        except ImportError as e:  # pragma: no cover - mitmproxy always brings it
            raise ValueError(f"no YAML parser available ({e})") from e
        import io

        try:
            return YAML(typ="safe", pure=True).load(io.StringIO(raw.decode("utf-8")))
        except Exception as e:  # ruamel raises its own error types
            raise ValueError(f"not valid YAML: {e}") from e
    text = raw.decode("utf-8-sig")
    try:
        return json.loads(text)
    except ValueError:
        return json.loads(strip_jsonc(text))


def strip_jsonc(text: str) -> str:
    """JSON with comments and trailing commas (opencode.jsonc, Claude Code settings) to plain JSON."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        elif text.startswith("//", i):
            while i < n and text[i] != "\n":
                i += 1
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            i = n if end < 0 else end + 2
        else:
            out.append(c)
            i += 1
    return re.sub(r",(\s*[}\]])", r"\1", "".join(out))


def expand(value: str, env: Mapping[str, str]) -> str:
    """``$VAR``, ``${VAR}`` and opencode's ``{env:VAR}`` references, from ``env``."""
    return _ENV_REF.sub(lambda m: env.get(m.group(1) or m.group(2) or m.group(3), ""), value)


def base_urls(data: Any, env: Mapping[str, str]) -> list[str]:
    """Every string under a base-URL-like key (``baseUrl``, ``base_url``, ``baseURL``, ...) or in an
    ``env`` table's ``*_BASE_URL`` variables, anywhere in a parsed configuration."""
    found: list[str] = []

    def walk(node: Any, depth: int) -> None:
        if depth > 12:
            return
        if isinstance(node, Mapping):
            for k, v in node.items():
                key = str(k).lower()
                if isinstance(v, str) and (key in _BASE_URL_KEYS or key.endswith("_base_url")):
                    url = expand(v.strip(), env)
                    if "://" in url:
                        found.append(url)
                else:
                    walk(v, depth + 1)
        elif isinstance(node, list):
            for v in node:
                walk(v, depth + 1)

    walk(data, 0)
    return found


def _home(env: Mapping[str, str]) -> Path:
    return Path(env.get("HOME") or os.path.expanduser("~"))


def _xdg_config(env: Mapping[str, str]) -> Path:
    return Path(env["XDG_CONFIG_HOME"]) if env.get("XDG_CONFIG_HOME") else _home(env) / ".config"


def _up_to_root(cwd: Path, env: Mapping[str, str]) -> list[Path]:
    """``cwd`` and its parents up to the git root (or the home directory, or /)."""
    out: list[Path] = []
    home = _home(env)
    d = cwd.resolve() if cwd.exists() else cwd
    while True:
        out.append(d)
        if (d / ".git").exists() or d == home or d.parent == d:
            return out
        d = d.parent


# -- where each agent keeps its base URLs ------------------------------------------------------------
def _claude_files(env: Mapping[str, str], cwd: Path) -> list[Path]:
    base = Path(env["CLAUDE_CONFIG_DIR"]) if env.get("CLAUDE_CONFIG_DIR") else _home(env) / ".claude"
    return [Path("/etc/claude-code/managed-settings.json"), base / "settings.json",
            cwd / ".claude" / "settings.json", cwd / ".claude" / "settings.local.json"]


def codex_home(env: Mapping[str, str]) -> Path:
    return Path(env["CODEX_HOME"]) if env.get("CODEX_HOME") else _home(env) / ".codex"


def _codex_files(env: Mapping[str, str], cwd: Path) -> list[Path]:
    return [codex_home(env) / "config.toml", cwd / ".codex" / "config.toml"]


def pi_agent_dir(env: Mapping[str, str]) -> Path:
    return Path(env["PI_CODING_AGENT_DIR"]) if env.get("PI_CODING_AGENT_DIR") else _home(env) / ".pi" / "agent"


def _pi_files(env: Mapping[str, str], cwd: Path) -> list[Path]:
    return [pi_agent_dir(env) / "models.json", cwd / ".pi" / "models.json"]


def omp_agent_dir(env: Mapping[str, str]) -> Path:
    if env.get("PI_CODING_AGENT_DIR"):
        return Path(env["PI_CODING_AGENT_DIR"])
    return _home(env) / (env.get("PI_CONFIG_DIR") or ".omp") / "agent"


def _omp_files(env: Mapping[str, str], cwd: Path) -> list[Path]:
    d = omp_agent_dir(env)
    return [d / "models.yml", d / "models.yaml", d / "models.json"]


def _opencode_files(env: Mapping[str, str], cwd: Path) -> list[Path]:
    out = []
    if env.get("OPENCODE_CONFIG"):
        out.append(Path(env["OPENCODE_CONFIG"]))
    g = _xdg_config(env) / "opencode"
    out += [g / "config.json", g / "opencode.json", g / "opencode.jsonc"]
    for d in reversed(_up_to_root(cwd, env)):
        out += [d / "opencode.json", d / "opencode.jsonc", d / ".opencode" / "opencode.json",
                d / ".opencode" / "opencode.jsonc"]
    return out


def hermes_home(env: Mapping[str, str]) -> Path:
    return Path(env["HERMES_HOME"]) if env.get("HERMES_HOME") else _home(env) / ".hermes"


def _hermes_files(env: Mapping[str, str], cwd: Path) -> list[Path]:
    return [hermes_home(env) / "config.yaml"]


_PI_HOSTS = (ANTHROPIC, OPENAI, CHATGPT, GEMINI, OPENROUTER) + OTHER_PROVIDERS

AGENTS: dict[str, Agent] = {
    a.name: a
    for a in (
        Agent(
            "claude", "Claude Code", "claude", NODE_CA, (ANTHROPIC,), _claude_files,
            env_base_urls=("ANTHROPIC_BASE_URL",), package="npm:@anthropic-ai/claude-code",
            tested_version="2.1.197", mcp=True, env_table=True,
        ),
        Agent(
            "codex", "Codex CLI", "codex", BUNDLE_CA, (OPENAI, CHATGPT), _codex_files,
            env_base_urls=("OPENAI_BASE_URL",), package="npm:@openai/codex", tested_version="0.171.0",
            daemons=("app-server",), bundle_vars=(CODEX_CA,),
            mcp=True,
        ),
        Agent(
            "pi", "pi", "pi", NODE_CA, _PI_HOSTS, _pi_files, package="npm:@mariozechner/pi-coding-agent",
            tested_version="0.73.1",
        ),
        Agent(
            "omp", "oh-my-pi", "omp", NODE_CA, _PI_HOSTS, _omp_files, proxy_vars=("PI_PROXY",),
            package="npm:@oh-my-pi/pi-coding-agent", tested_version="18.2.3", mcp=True,
        ),
        Agent(
            "opencode", "opencode", "opencode", NODE_CA,
            (ANTHROPIC, OPENAI, GEMINI, OPENROUTER) + OTHER_PROVIDERS, _opencode_files,
            package="npm:opencode-ai", tested_version="1.18.33", mcp=True,
        ),
        Agent(
            "hermes", "Hermes Agent", "hermes", BUNDLE_CA,
            (OPENROUTER, "inference-api.nousresearch.com", ANTHROPIC, OPENAI, CHATGPT, GEMINI) + OTHER_PROVIDERS,
            _hermes_files, env_base_urls=("OPENAI_BASE_URL", "ANTHROPIC_BASE_URL"), package="pypi:hermes-agent",
            tested_version="0.19.0", mcp=True,
        ),
    )
}


def all_builtin_hosts() -> list[str]:
    out: list[str] = []
    for a in AGENTS.values():
        for h in a.builtin_hosts:
            if h not in out:
                out.append(h)
    return out


def intercept_plan(agent: Agent | None, env: Mapping[str, str], cwd: Path | None = None,
                   extra: Iterable[str] = ()) -> HostPlan:
    """The hosts a proxy started for ``agent`` intercepts: the agent's built-in and configured model
    hosts, then every other agent's built-in model hosts (so agents launched later can share the
    proxy), then ``extra`` (``host`` or ``host:port``).  ``agent=None``: every agent's configuration."""
    agents = [agent] if agent is not None else list(AGENTS.values())
    plan = HostPlan()
    for a in agents:
        p = a.model_hosts(env, cwd)
        for h in p.hosts:
            plan.add(*h)
        plan.endpoints += p.endpoints
        plan.notes += [n for n in p.notes if n not in plan.notes]
    for h in all_builtin_hosts():
        plan.add(h)
    for item in extra:
        host, _, port = item.strip().rpartition(":") if re.search(r":\d+$", item.strip()) else (item.strip(), "", "")
        plan.add(host, int(port) if port else 443)
    return plan


def allow_hosts_regex(hosts: Iterable[tuple[str, int]]) -> str:
    """One regular expression for mitmproxy's ``allow_hosts``.  mitmproxy searches it in
    ``host:port`` strings (the CONNECT target, the TLS SNI and the Host header, each with the port),
    so every alternative is anchored and names its port."""
    alts = [f"{re.escape(h.lower())}:{int(p)}" for h, p in hosts]
    if not alts:
        raise ValueError("no hosts to intercept")
    return r"^(?:" + "|".join(alts) + r")$"

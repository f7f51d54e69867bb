"""Money: what a model's tokens cost, per provider and model, in US dollars per million tokens.

The built-in table is dated (:data:`AS_OF`): providers change prices, so a user file
``<data dir>/prices.json`` overrides or extends it, model by model::

    {"as_of": "2026-01-15",
     "models": {"claude-sonnet-4-5": {"provider": "anthropic", "input": 3, "cache_write_5m": 3.75,
                                      "cache_write_1h": 6, "cache_read": 0.3, "output": 15}}}

A model is found by its name with any routing prefix removed (``anthropic/``, ``us.anthropic.``):
a table key, or a key followed by a snapshot's date and the routers' version suffixes only
(``claude-sonnet-4-5-20250929``, ``gpt-5-mini-2025-08-07``, ``...@20250929``, ``...-v1:0``,
``-latest``).  Another model whose name merely begins with a key (``claude-opus-4-6``, ``gpt-5-pro``,
``o3-mini``, ``gemini-2.5-flash-lite``: priced otherwise) is not found, and a model that is not found
has no price: stats and the page then show tokens only, never a guess.

Token figures follow the store (:mod:`bili_addon.store`): ``input`` is every prompt token, cached
or not; ``cache_read`` and ``cache_write`` are the parts of it read from and written to the cache.
The uncached rest is ``input - cache_read - cache_write``.

What a session "would have cost without bili" (:func:`without_bili`) is deliberately conservative:
the difference between what the agent sent and what bili sent is priced as cache reads, the
cheapest way those tokens could have gone; the claimed saving is never more than that (and it is
negative while bili's own tools and prompt outweigh what it folded).

Standard library only (``bili stats`` uses it without mitmproxy).  ``cost()`` is the function the
cache-clock cost model and ``bili replay --cost`` call for absolute prices.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

log = logging.getLogger("bili")

AS_OF = "2025-11-01"  # when the built-in prices were last checked against the providers' pages
USER_FILE = "prices.json"
MTOK = 1_000_000
ONE_MILLION = "[1m]"  # after a model's name in the store: its request asked for the 1M-token window
LONG_PROMPT = 200_000  # prompt tokens over which a model's long-context price applies (Price.long_input)


@dataclass(frozen=True, slots=True)
class Price:
    """US dollars per million tokens."""

    provider: str
    input: float
    cache_write_5m: float
    cache_write_1h: float
    cache_read: float
    output: float
    # a request whose prompt is over LONG_PROMPT tokens pays these for its input and output, and its cache
    # writes and reads in the same proportion as its input (Anthropic's 1M-token context, Gemini 2.5 Pro):
    # the whole request, not only the tokens past the line; 0: the model has no such price
    long_input: float = 0.0
    long_output: float = 0.0

    def write(self, ttl: str) -> float:
        return self.cache_write_1h if ttl == "1h" else self.cache_write_5m

    @property
    def long_rate(self) -> float:
        """What a request over the line pays per prompt token, as a multiple of the price under it (1.0: no tier)."""
        return self.long_input / self.input if self.long_input and self.input else 1.0

    def at(self, prompt: int, long: bool | None = None) -> "Price":
        """The price a request of ``prompt`` prompt tokens pays (``long``: whether it is over the line,
        when the caller knows it: sums of turns)."""
        if not self.long_input or not (prompt > LONG_PROMPT if long is None else long):
            return self
        f = self.long_rate
        return Price(self.provider, self.long_input, self.cache_write_5m * f, self.cache_write_1h * f,
                     round(self.cache_read * f, 6), self.long_output or self.output)


def _a(inp: float, out: float, long_in: float = 0.0, long_out: float = 0.0) -> Price:
    """Anthropic: cache writes cost 1.25x (5 minutes) or 2x (1 hour) the input, reads 0.1x."""
    return Price("anthropic", inp, inp * 1.25, inp * 2, round(inp * 0.1, 6), out, long_in, long_out)


def _o(inp: float, read: float, out: float, provider: str = "openai", long_in: float = 0.0,
       long_out: float = 0.0) -> Price:
    """OpenAI and Google: caching is automatic, a write costs what input does."""
    return Price(provider, inp, inp, inp, read, out, long_in, long_out)


BUILTIN: dict[str, Price] = {
    # Anthropic
    "claude-opus-4-5": _a(5, 25), "claude-opus-4-1": _a(15, 75), "claude-opus-4": _a(15, 75),
    # (Sonnet 4 and 4.5 take prompts over 200K tokens with the 1M-context beta, at 2x input and 1.5x output)
    "claude-sonnet-4-5": _a(3, 15, 6, 22.5), "claude-sonnet-4": _a(3, 15, 6, 22.5), "claude-3-7-sonnet": _a(3, 15),
    "claude-3-5-sonnet": _a(3, 15), "claude-haiku-4-5": _a(1, 5), "claude-3-5-haiku": _a(0.8, 4),
    "claude-3-haiku": Price("anthropic", 0.25, 0.30, 0.50, 0.03, 1.25),
    # OpenAI
    "gpt-5": _o(1.25, 0.125, 10), "gpt-5-codex": _o(1.25, 0.125, 10), "gpt-5.1": _o(1.25, 0.125, 10),
    "gpt-5.1-codex": _o(1.25, 0.125, 10), "gpt-5-mini": _o(0.25, 0.025, 2), "gpt-5-nano": _o(0.05, 0.005, 0.4),
    "gpt-4.1": _o(2, 0.5, 8), "gpt-4.1-mini": _o(0.4, 0.1, 1.6), "gpt-4.1-nano": _o(0.1, 0.025, 0.4),
    "gpt-4o": _o(2.5, 1.25, 10), "gpt-4o-mini": _o(0.15, 0.075, 0.6),
    "o3": _o(2, 0.5, 8), "o4-mini": _o(1.1, 0.275, 4.4),
    # Google (2.5 Pro: prompts over 200K tokens at 2x input and 1.5x output)
    "gemini-2.5-pro": _o(1.25, 0.125, 10, "google", 2.5, 15), "gemini-2.5-flash": _o(0.3, 0.03, 2.5, "google"),
}


@dataclass(frozen=True, slots=True)
class Cost:
    """One priced usage, in US dollars."""

    model: str  # the table key that priced it
    uncached: float
    cache_write: float
    cache_read: float
    output: float

    @property
    def total(self) -> float:
        return self.uncached + self.cache_write + self.cache_read + self.output


@dataclass
class Table:
    prices: dict[str, Price] = field(default_factory=lambda: dict(BUILTIN))
    as_of: str = AS_OF
    source: str = "built-in"
    errors: list[str] = field(default_factory=list)

    def find(self, model: str) -> tuple[str, Price] | None:
        name = normalise(model)
        if not name:
            return None
        best = max((k for k in self.prices if name.startswith(k) and _SNAPSHOT.fullmatch(name, len(k))),
                   key=len, default=None)
        return (best, self.prices[best]) if best else None

    def cost(self, model: str, input: int, cache_read: int = 0, cache_write: int = 0, output: int = 0,
             *, ttl: str = "5m", cache_write_1h: int = 0, long: bool | None = None) -> Cost | None:
        """``cache_write_1h``: the part of ``cache_write`` written for 1 hour (the rest at ``ttl``'s
        rate; Anthropic reports the split, ``usage.cache_creation``).  ``long``: whether the usage is of
        requests over :data:`LONG_PROMPT` (None: one request, over it when ``input`` is)."""
        hit = self.find(model)
        if hit is None:
            return None
        key, p = hit
        p = p.at(input, long)
        uncached = max(0, input - cache_read - cache_write)
        long = min(max(0, cache_write_1h), cache_write)
        write = (cache_write - long) * p.write(ttl) + long * p.cache_write_1h
        return Cost(key, uncached * p.input / MTOK, write / MTOK, cache_read * p.cache_read / MTOK,
                    output * p.output / MTOK)


def read_share(model: str) -> float | None:
    """What a cache read of ``model`` costs as a share of its input price, by the built-in table (the
    cache model's read rate: :mod:`bili_addon.kernel.cache`); None where the table has no such model."""
    hit = _BUILTIN_TABLE.find(model)
    return round(hit[1].cache_read / hit[1].input, 6) if hit is not None and hit[1].input else None


_BUILTIN_TABLE = Table()


# what may follow a table key in a model's name and still name that model: a snapshot's date, then
# the routers' version (Bedrock ``-v1:0``, Vertex ``@20250929``) or ``-latest``
_SNAPSHOT = re.compile(r"(?:-(?:\d{8}|\d{4}-\d{2}-\d{2}))?(?:-v\d+(?::\d+)?)?(?:@[\w.-]+)?(?:-latest)?")


def normalise(model: str) -> str:
    """``anthropic/claude-x`` / ``us.anthropic.claude-x-v1:0`` / ``models/gemini-x`` -> the bare name
    (and ``claude-x[1m]``, a request that asked for the 1M-token window: :func:`may_go_long`)."""
    name = (model or "").strip().lower().rsplit("/", 1)[-1].removesuffix(ONE_MILLION)
    i = name.find("claude-")
    return name[i:] if i > 0 else name


_PRICE_FIELDS = tuple(f.name for f in fields(Price) if f.name != "provider")


def load(data_dir: str | os.PathLike[str] | None = None) -> Table:
    """The built-in table with ``<data dir>/prices.json`` over it.  A bad file (or entry) is reported
    in ``errors`` and ignored, the rest of the table stands."""
    table = Table()
    if not data_dir:
        return table
    path = Path(data_dir) / USER_FILE
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return table
    except (OSError, ValueError) as e:
        table.errors.append(f"{path}: cannot read ({e}); the built-in prices of {AS_OF} apply")
        return table
    models = doc.get("models") if isinstance(doc, dict) else None
    if not isinstance(models, dict):
        table.errors.append(f"{path}: expected {{\"as_of\": DATE, \"models\": {{NAME: PRICES}}}}; ignored")
        return table
    for name, entry in models.items():
        price = _entry(name, entry, table.prices.get(normalise(name)))
        if isinstance(price, str):
            table.errors.append(f"{path}: {name}: {price}; ignored")
        else:
            table.prices[normalise(name)] = price
    table.as_of = str(doc.get("as_of") or "undated") + f" ({path.name}), built-in {AS_OF}"
    table.source = str(path)
    return table


def _entry(name: str, entry: object, base: Price | None) -> Price | str:
    """One user entry: given fields over the built-in price of the same model (if any); a new model
    needs input and output, its cache prices default to the input price (no cache discount)."""
    if not isinstance(entry, dict):
        return "expected an object of prices per million tokens"
    given: dict[str, float] = {}
    for k in _PRICE_FIELDS:
        v = entry.get(k)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            return f"{k} must be a number >= 0"
        given[k] = float(v)
    if base is None:
        missing = [k for k in ("input", "output") if k not in given]
        if missing:
            return "missing " + " and ".join(missing)
        given.setdefault("cache_write_5m", given["input"])
        given.setdefault("cache_write_1h", given["cache_write_5m"])
        given.setdefault("cache_read", given["input"])
    elif base.long_input and ("input" in given or "output" in given):
        # a tier the entry does not set keeps its proportion to the prices the entry sets (2x input...)
        if "input" in given and "long_input" not in given:
            given["long_input"] = base.long_input * given["input"] / base.input if base.input else 0.0
        if "output" in given and "long_output" not in given:
            given["long_output"] = base.long_output * given["output"] / base.output if base.output else 0.0
    if given.get("long_output") and not given.get("long_input", getattr(base, "long_input", 0.0)):
        return "long_output needs long_input (the input price of a request over the long-context line)"
    vals = {k: given.get(k, getattr(base, k, 0.0)) for k in _PRICE_FIELDS}
    provider = entry.get("provider")
    if not isinstance(provider, str):
        provider = base.provider if base else ""
    return Price(provider, **vals)


_default: Table | None = None


def default() -> Table:
    global _default
    if _default is None:
        _default = Table()
    return _default


def cost(model: str, input: int, cache_read: int = 0, cache_write: int = 0, output: int = 0, *,
         ttl: str = "5m", cache_write_1h: int = 0, table: Table | None = None, long: bool | None = None) -> Cost | None:
    """What one usage cost in US dollars (None: the model has no price).  ``input`` is every prompt
    token (cached or not, as the store records it); ``ttl``: the cache writes' lifetime (5m or 1h);
    ``cache_write_1h``: the part of the writes made for 1 hour, at that rate whatever ``ttl`` says;
    ``long``: usage summed over requests over :data:`LONG_PROMPT` (True) or not (False); None: one
    request's, over the line when ``input`` is."""
    return (table or default()).cost(model, input, cache_read, cache_write, output, ttl=ttl,
                                     cache_write_1h=cache_write_1h, long=long)


def long_factor(model: str, table: Table | None = None) -> float:
    """What a request of ``model`` over :data:`LONG_PROMPT` pays per prompt token, as a multiple of its
    price under it (Sonnet 4.5: 2.0); 1.0 for a model without a long-context price or without a price."""
    hit = (table or default()).find(model)
    return hit[1].long_rate if hit is not None else 1.0


def may_go_long(model: str, table: Table | None = None) -> bool:
    """Whether a request to ``model`` may have more than :data:`LONG_PROMPT` prompt tokens: Anthropic
    refuses one unless it asked for the 1M-token window (``anthropic-beta: context-1m-...``, recorded
    as ``model[1m]``); Google's models take them as they are.  (What the agent's own request would have
    cost is priced at the long-context price only where it could have gone out so.)"""
    hit = (table or default()).find(model)
    return hit is not None and (hit[1].provider != "anthropic" or (model or "").strip().lower().endswith(ONE_MILLION))


def without_bili(model: str, input: int, cache_read: int, cache_write: int, output: int, folded_tokens: int, *,
                 ttl: str = "5m", cache_write_1h: int = 0, table: Table | None = None) -> Cost | None:
    """What the same turn would have cost had the agent's own request gone out: ``folded_tokens``
    (what the agent sent minus what bili sent) priced as cache reads, the cheapest way they could have
    gone, so a saving claimed is a lower bound.  Negative ``folded_tokens`` (bili's tools, prompt and
    tags outweigh what it folded) make the saving negative: bili's additions are never free, and they
    are taken off where this turn paid the most for its tokens (:func:`added_where`: on a turn that
    wrote the cache they were written, not read), so the saving stays a lower bound then too."""
    removed = max(0, folded_tokens)
    taken = added_where(max(0, -folded_tokens), input, cache_read, cache_write, cache_write_1h)
    return without_bili_sums(model, input, cache_read, cache_write, output, removed, taken, ttl=ttl,
                             cache_write_1h=cache_write_1h, table=table,
                             over=None if may_go_long(model, table) else False)


def added_where(extra: int, input: int, cache_read: int, cache_write: int, cache_write_1h: int
                ) -> tuple[int, int, int, int]:
    """Where ``extra`` tokens bili added to a turn are taken off, the dearest first: ``(from the
    1-hour writes, from the other writes, from the uncached input, from the reads)``."""
    long = min(extra, max(0, min(cache_write_1h, cache_write)))
    short = min(extra - long, max(0, cache_write - long))
    plain = min(extra - long - short, max(0, input - cache_read - cache_write))
    read = min(extra - long - short - plain, max(0, cache_read))
    return long, short, plain, read


def without_bili_sums(model: str, input: int, cache_read: int, cache_write: int, output: int, removed: int,
                      taken: tuple[int, int, int, int], *, ttl: str = "5m", cache_write_1h: int = 0,
                      table: Table | None = None, over: bool | None = None) -> Cost | None:
    """:func:`without_bili` of turns summed (the cost is linear in each figure, on either side of
    :data:`LONG_PROMPT`: ``over``, whether the agent's own requests were over it, None for one turn's
    figures): ``removed`` the tokens bili took off them (priced as reads), ``taken`` the sums of
    :func:`added_where` of what it added."""
    long, short, plain, read = taken
    return cost(model, input + removed - long - short - plain - read, cache_read + removed - read,
                cache_write - long - short, output, ttl=ttl, cache_write_1h=max(0, cache_write_1h - long), table=table,
                long=over)


def money(usd: float | None) -> str:
    """``$0.041``, ``$1.23``, ``$120``; '' for no price."""
    if usd is None:
        return ""
    if usd < 0:
        return "-" + money(-usd) if usd <= -0.0005 else "$0.000"
    if usd < 0.995:
        return f"${usd:.3f}"
    if usd < 99.5:
        return f"${usd:.2f}"
    return f"${usd:,.0f}"


__all__ = ["AS_OF", "BUILTIN", "LONG_PROMPT", "ONE_MILLION", "Cost", "Price", "Table", "added_where", "cost", "default",
           "load", "long_factor", "may_go_long", "money", "normalise", "without_bili", "without_bili_sums"]

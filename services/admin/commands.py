"""`prefixcache stats | top | inspect | match | namespaces | evict | flush | pin | unpin | pins |
warm`: the operator commands' flags and examples.

`register(subparsers)` adds the eleven parsers and sets each one's `handler`
(handlers.py and top.py). Every command shares the connection flags of
connect.py (`--cache`, `--auth-token`/env PREFIXCACHE_AUTH_TOKEN, `--timeout`,
`--tls`, `--tls-ca`). Heavy modules (the worker's model) load only when a
command needs them. The JSON documents are specified in docs/cli.md.
"""

from __future__ import annotations

import argparse
import textwrap

from . import handlers, top
from .connect import add_connection_arguments
from .prompt import add_identity_arguments, add_prompt_arguments

STATS_EXAMPLES = """examples:
  prefixcache stats --cache 127.0.0.1:50051
  prefixcache stats --cache cache.internal:50051 --json | jq '.tokens.hit_rate'
  PREFIXCACHE_AUTH_TOKEN=$(cat token) prefixcache stats --cache 10.0.0.5:50051 --tls-ca ca.pem
"""
TOP_EXAMPLES = """examples:
  prefixcache top --cache 127.0.0.1:50051              # q or Ctrl-C quits
  prefixcache top --cache 127.0.0.1:50051 --interval 5
  prefixcache top --cache 127.0.0.1:50051 --iterations 3 > frames.txt   # not a terminal: plain frames
"""
INSPECT_EXAMPLES = """examples:
  prefixcache inspect --cache 127.0.0.1:50051 --text "You are a helpful assistant..."
  prefixcache inspect --text "What is the capital of France?" --chat      # as the worker renders a chat
  prefixcache inspect --tokens-file prompt.json --namespace 3f2a...        # ids as a JSON list
  prefixcache inspect --text "..." --model /models/Qwen2.5-0.5B-Instruct --dtype bfloat16 --json
"""
MATCH_EXAMPLES = """examples:
  prefixcache match --cache 127.0.0.1:50051 --text "You are a helpful assistant..."
  prefixcache match --tokens-file prompt.json --namespace 3f2a... --json | jq .tiers
"""
NAMESPACES_EXAMPLES = """examples:
  prefixcache namespaces --cache 127.0.0.1:50051
  prefixcache namespaces --json | jq -r '.namespaces[] | select(.model == "tiny") | .namespace_id'
"""
EVICT_EXAMPLES = """examples:
  prefixcache evict --cache 127.0.0.1:50051 --namespace 3f2a...            # all blocks of a namespace
  prefixcache evict --older-than 10m                                        # not accessed for 10 minutes
  prefixcache evict --older-than 1h --namespace 3f2a...
  prefixcache evict --prefix-text "You are a helpful assistant"             # prompts starting so (tiny worker)
"""
FLUSH_EXAMPLES = """examples:
  prefixcache flush --cache 127.0.0.1:50051          # asks for confirmation
  prefixcache flush --cache 127.0.0.1:50051 --yes    # scripts (required without a terminal)
"""
PIN_EXAMPLES = """examples:
  prefixcache pin --cache 127.0.0.1:50051 --text "You are a helpful assistant..."   # until unpinned
  prefixcache pin --tokens-file system.json --namespace 3f2a... --ttl 24h --priority 80
  prefixcache pins --json | jq '.pins[].pin_id'
  prefixcache unpin 1234567890
  prefixcache warm --text "You are a helpful assistant..."       # Redis -> host tier ahead of traffic
"""


def _parser(subparsers, name: str, help_text: str, description: str, examples: str) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        name,
        help=help_text,
        description=textwrap.fill(description, 79),
        epilog=examples,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_connection_arguments(parser)
    return parser


def _add_json(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--json", action="store_true", help=f"print {what} as JSON (schema: docs/cli.md)")


def _register_stats(subparsers) -> None:
    parser = _parser(
        subparsers,
        "stats",
        "counters of a running cache service",
        "Hit rates by request, block and token; tokens saved; per-tier blocks, bytes and capacity; "
        "spills; promotions; evictions by reason; miss reasons; Redis tier state; active leases; "
        "uptime.",
        STATS_EXAMPLES,
    )
    _add_json(parser, "one document (stable schema, with schema_version)")
    parser.set_defaults(handler=handlers.stats)


def _register_top(subparsers) -> None:
    parser = _parser(
        subparsers,
        "top",
        "live view of a cache service (rates, hit rate, occupancy)",
        "Refreshes every --interval: rates per second, hit rate over the last minute, tier "
        "occupancy, recent evictions. q or Ctrl-C quits.",
        TOP_EXAMPLES,
    )
    parser.add_argument(
        "--interval", type=float, default=1.0, metavar="SECONDS", help="seconds between refreshes (default %(default)s)"
    )
    parser.add_argument(
        "--iterations",
        type=int,
        default=None,
        metavar="N",
        help="stop after N refreshes (default: until q; 1 when stdout is not a terminal)",
    )
    parser.set_defaults(handler=top.run)


def _register_inspect(subparsers) -> None:
    parser = _parser(
        subparsers,
        "inspect",
        "how much of a prompt is cached, block by block",
        "Tokenizes a prompt like the worker does and shows, for each cached block, its tier, slot, "
        "TTL left and last access, then why the first uncached block missed. Read-only: refreshes "
        "no TTL and counts no lookup. Without --namespace the namespace is derived from the "
        "worker's settings (this loads the model to compute its weights digest).",
        INSPECT_EXAMPLES,
    )
    add_prompt_arguments(parser, "--text", "the prompt")
    add_identity_arguments(parser)
    parser.add_argument(
        "--max-rows",
        type=int,
        default=40,
        metavar="N",
        help="blocks shown in the table; the middle is elided beyond (default %(default)s)",
    )
    _add_json(parser, "the report")
    parser.set_defaults(handler=handlers.inspect)


def _register_match(subparsers) -> None:
    parser = _parser(
        subparsers,
        "match",
        "how many leading blocks of a prompt each tier holds (a router's view)",
        "Asks the service's Match, what a router asks: the prompt's cached prefix as blocks per "
        "local tier, and how many of them the service believes Redis still holds. Takes no lease, "
        "refreshes no TTL, counts no lookup and does not ask Redis. The prompt and namespace flags "
        "are inspect's.",
        MATCH_EXAMPLES,
    )
    add_prompt_arguments(parser, "--text", "the prompt")
    add_identity_arguments(parser)
    _add_json(parser, "the answer")
    parser.set_defaults(handler=handlers.match)


def _register_evict(subparsers) -> None:
    parser = _parser(
        subparsers,
        "evict",
        "evict blocks by namespace, age or prompt prefix",
        "Evicts unpinned blocks from every tier. --namespace alone: the whole namespace; "
        "--older-than: blocks not accessed for that long (in --namespace, else everywhere the token "
        "may act); a prefix: every cached prompt starting with it (namespace given or derived "
        "from the worker's settings).",
        EVICT_EXAMPLES,
    )
    parser.add_argument("--older-than", default=None, metavar="DURATION", help="e.g. 90s, 10m, 2h")
    add_prompt_arguments(parser, "--prefix-text", "the prefix")
    add_identity_arguments(parser)
    _add_json(parser, "the result")
    parser.set_defaults(handler=handlers.evict)


def _register_namespaces(subparsers) -> None:
    parser = _parser(
        subparsers,
        "namespaces",
        "the namespaces a credential can see, with resident blocks",
        "Every namespace of this credential's tenant (an admin's token: every tenant's, with the "
        "tenant named): id, model, revision, whether a cache salt made it, and the blocks and bytes "
        "it holds in the local tiers. The ids are what inspect --namespace and evict --namespace take.",
        NAMESPACES_EXAMPLES,
    )
    _add_json(parser, "one document")
    parser.set_defaults(handler=handlers.namespaces)


def _register_flush(subparsers) -> None:
    parser = _parser(
        subparsers,
        "flush",
        "evict every unpinned block (asks first)",
        "Evicts every unpinned block of every tier (a tenant's token: its own namespaces). Asks for "
        "confirmation on a terminal; without one, --yes is required.",
        FLUSH_EXAMPLES,
    )
    parser.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    _add_json(parser, "the result")
    parser.set_defaults(handler=handlers.flush)


def _register_pins(subparsers) -> None:
    parser = _parser(
        subparsers,
        "pin",
        "keep a prompt prefix cached (LRU, TTL and flush leave it)",
        "Pins the cached part of a prompt prefix in its namespace (promoted from Redis first, so it "
        "also warms a prefix only Redis holds): LRU eviction, block TTL and flush leave it in the "
        "host tier until `unpin` or --ttl. Fails, naming the prefix, when no tier holds any of it. "
        "When promoting it finds the host tier (or the tenant's host quota) held by pins, the tenant's "
        "pins of lower --priority are released, lowest first; nothing else ends a pin early. With Redis, "
        "its blocks' keys live while pinned. A tenant's token pins only its own namespaces.",
        PIN_EXAMPLES,
    )
    add_prompt_arguments(parser, "--text", "the prefix")
    parser.add_argument("--ttl", default=None, metavar="DURATION", help="e.g. 30m, 24h (default: until unpinned)")
    parser.add_argument(
        "--priority",
        type=int,
        default=None,
        metavar="N",
        help="0..100 (default 0): a pin that needs room releases the tenant's pins of lower priority first",
    )
    add_identity_arguments(parser)
    _add_json(parser, "the pin")
    parser.set_defaults(handler=handlers.pin)

    parser = _parser(
        subparsers, "unpin", "end a pin", "Ends a pin (ids: `prefixcache pins`); its blocks age as usual.", PIN_EXAMPLES
    )
    parser.add_argument("pin_id", type=int, metavar="PIN_ID", help="the id `pin` or `pins` printed")
    _add_json(parser, "the result")
    parser.set_defaults(handler=handlers.unpin)

    parser = _parser(
        subparsers,
        "pins",
        "the live pins a credential can see",
        "Every live pin of this credential's tenant (an admin's: every tenant's): id, namespace, "
        "pinned tokens, priority, time left.",
        PIN_EXAMPLES,
    )
    _add_json(parser, "one document")
    parser.set_defaults(handler=handlers.pins)

    parser = _parser(
        subparsers,
        "warm",
        "promote a prompt prefix from Redis into the host tier",
        "Looks a prompt prefix up once, as a worker would (it counts as a lookup), so the blocks "
        "only Redis holds are promoted into the host tier ahead of traffic; says how much of it the "
        "host tier now holds, or, exit 1, that no tier holds any of it. `pin` does the same and "
        "keeps it there.",
        PIN_EXAMPLES,
    )
    add_prompt_arguments(parser, "--text", "the prefix")
    add_identity_arguments(parser)
    _add_json(parser, "the result")
    parser.set_defaults(handler=handlers.warm)


def register(subparsers) -> None:
    _register_stats(subparsers)
    _register_top(subparsers)
    _register_inspect(subparsers)
    _register_match(subparsers)
    _register_namespaces(subparsers)
    _register_evict(subparsers)
    _register_flush(subparsers)
    _register_pins(subparsers)

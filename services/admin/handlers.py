"""The handlers of `stats`, `inspect`, `match`, `namespaces`, `evict`, `flush`, `pin`, `unpin`, `pins` and
`warm` (argparse namespace in, exit code out).

Each opens one client through `connect()`, makes its calls, and prints either
rich output or one JSON document (`--json`) on stdout. Errors leave as
one-line `PrefixCacheError`s (see connect.py); a refused confirmation exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

from rich.console import Console

from prefixcache.config import parse_duration
from prefixcache.kinds import TierKind
from prefixcache.retention import check_priority

from .connect import AdminError, connect
from .document import SCHEMA_VERSION, stats_document
from .inspect_view import inspect_document, inspect_view
from .match_view import match_document, match_view
from .namespaces_view import namespaces_document, namespaces_view
from .prompt import prompt_tokens, resolve_namespace
from .stats_view import stats_view


def _print_json(document: dict) -> None:
    try:
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away: not an error. Point stdout at devnull so
        # the interpreter's final flush does not raise again (Python's documented recipe).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def stats(args: argparse.Namespace) -> int:
    with connect(args) as client:
        document = stats_document(client.stats(), client.address)
    if args.json:
        _print_json(document)
    else:
        Console().print(stats_view(document))
    return 0


def _prompt_report(args: argparse.Namespace, verb: str, ask: Callable, document_of: Callable, view: Callable) -> int:
    """`inspect` and `match`: one call about a prompt in the namespace the flags name, then print."""
    tokens = prompt_tokens(args, args.text, args.tokens_file)
    if not tokens:
        raise AdminError(f"the prompt is empty: nothing to {verb}")
    with connect(args) as client:
        service = client.stats()
        namespace_id, identity = resolve_namespace(args, client, service)
        block_size = service.layout.block_size if service.layout is not None else args.block_size
        report = None
        if namespace_id is not None and service.ready:
            report = ask(client)(tokens, cache_salt=args.cache_salt, namespace_id=namespace_id)
        document = document_of(client.address, namespace_id, identity, report, len(tokens), block_size)
    if args.json:
        _print_json(document)
    else:
        Console().print(view(document))
    return 0


def inspect(args: argparse.Namespace) -> int:
    return _prompt_report(
        args, "inspect", lambda c: c.inspect, inspect_document, lambda document: inspect_view(document, args.max_rows)
    )


def match(args: argparse.Namespace) -> int:
    return _prompt_report(args, "match", lambda c: c.match, match_document, match_view)


def evict(args: argparse.Namespace) -> int:
    older_than = None if args.older_than is None else parse_duration(args.older_than, "--older-than")
    prefix = args.prefix_text is not None or args.prefix_tokens_file is not None
    if not (args.namespace or older_than is not None or prefix):
        raise AdminError("give --namespace ID, --older-than DURATION or --prefix-text/--prefix-tokens-file")
    if prefix and older_than is not None:
        raise AdminError("--older-than cannot be combined with a prefix (the service evicts by one or the other)")
    tokens = prompt_tokens(args, args.prefix_text, args.prefix_tokens_file) if prefix else None
    if prefix and not tokens:
        raise AdminError("the prefix is empty: it would match every prompt; use --namespace to evict them all")
    with connect(args) as client:
        namespace_id = args.namespace
        if prefix and namespace_id is None:
            namespace_id, _ = resolve_namespace(args, client, client.stats())
        if prefix and namespace_id is None:
            evicted = 0  # no worker attached yet: nothing is cached
        else:
            evicted = client.evict(
                namespace_id=namespace_id, older_than_s=older_than, prefix_tokens=tokens, cache_salt=args.cache_salt
            )
        address = client.address
    if args.json:
        _print_json(
            {"schema_version": SCHEMA_VERSION, "address": address, "namespace_id": namespace_id, "evicted": evicted}
        )
    else:
        print(f"evicted {evicted:,} block(s) from {address}")
    return 0


def namespaces(args: argparse.Namespace) -> int:
    with connect(args) as client:
        entries, refused = client.namespace_report()
        layout = client.stats().layout
        document = namespaces_document(
            client.address, entries, layout.block_bytes if layout is not None else 0, refused
        )
    if args.json:
        _print_json(document)
    else:
        Console().print(namespaces_view(document))
    return 0


def _confirmed(address: str) -> bool:
    if not sys.stdin.isatty():
        raise AdminError("refusing to flush without confirmation: stdin is not a terminal; pass --yes")
    answer = input(f"Flush every unpinned block of every tier of the cache at {address}? [y/N] ")
    return answer.strip().lower() in ("y", "yes")


def flush(args: argparse.Namespace) -> int:
    with connect(args) as client:
        client.stats()  # fail on a wrong address or token before asking anything
        if not args.yes and not _confirmed(client.address):
            print("flush cancelled; nothing was evicted", file=sys.stderr)
            return 1
        evicted = client.flush()
        address = client.address
    if args.json:
        _print_json({"schema_version": SCHEMA_VERSION, "address": address, "evicted": evicted})
    else:
        print(f"flushed {evicted:,} block(s) from {address}")
    return 0


def _pin_entry(pin) -> dict:
    return {
        "pin_id": pin.pin_id,
        "namespace_id": pin.namespace_id,
        "pinned_tokens": pin.pinned_tokens,
        "expires_in_s": pin.expires_in_s,
        "priority": pin.priority,
    }


def _left(pin) -> str:
    return "no TTL" if pin.expires_in_s is None else f"{pin.expires_in_s:,.0f} s left"


def pin(args: argparse.Namespace) -> int:
    ttl_s = None if args.ttl is None else parse_duration(args.ttl, "--ttl")
    priority = None if args.priority is None else check_priority(args.priority, "--priority")
    tokens = prompt_tokens(args, args.text, args.tokens_file)
    if not tokens:
        raise AdminError("the prefix is empty: nothing to pin")
    with connect(args) as client:
        namespace_id, _ = resolve_namespace(args, client, client.stats())
        if namespace_id is None:
            raise AdminError("nothing is cached yet (no worker has attached): nothing to pin")
        made = client.pin(tokens, namespace_id=namespace_id, ttl_s=ttl_s, cache_salt=args.cache_salt, priority=priority)
        address = client.address
    if args.json:
        _print_json({"schema_version": SCHEMA_VERSION, "address": address, **_pin_entry(made)})
    else:
        print(
            f"pin {made.pin_id}: {made.pinned_tokens:,} of {len(tokens):,} token(s) pinned "
            f"(priority {made.priority}, {_left(made)}) at {address}"
        )
    return 0


def unpin(args: argparse.Namespace) -> int:
    with connect(args) as client:
        client.unpin(args.pin_id)
        address = client.address
    if args.json:
        _print_json({"schema_version": SCHEMA_VERSION, "address": address, "pin_id": args.pin_id})
    else:
        print(f"unpinned {args.pin_id} at {address}")
    return 0


def pins(args: argparse.Namespace) -> int:
    with connect(args) as client:
        found = client.pins()
        address = client.address
    if args.json:
        _print_json({"schema_version": SCHEMA_VERSION, "address": address, "pins": [_pin_entry(p) for p in found]})
        return 0
    if not found:
        print(f"no pins at {address}")
    for p in found:
        print(f"{p.pin_id}  {p.namespace_id}  {p.pinned_tokens:,} token(s)  priority {p.priority}  {_left(p)}")
    return 0


def warm(args: argparse.Namespace) -> int:
    tokens = prompt_tokens(args, args.text, args.tokens_file)
    if not tokens:
        raise AdminError("the prefix is empty: nothing to warm")
    with connect(args) as client:
        service = client.stats()
        namespace_id, _ = resolve_namespace(args, client, service)
        hit = None
        if namespace_id is not None:
            hit = client.lookup(tokens, cache_salt=args.cache_salt, take_lease=False, namespace_id=namespace_id)
        address = client.address
    block_size = service.layout.block_size if service.layout is not None else 0
    host = 0 if hit is None else int((hit.locations.tiers == TierKind.HOST).sum()) * block_size
    cached = 0 if hit is None else hit.hit_tokens
    if args.json:
        _print_json(
            {
                "schema_version": SCHEMA_VERSION,
                "address": address,
                "namespace_id": namespace_id,
                "prompt_tokens": len(tokens),
                "cached_tokens": cached,
                "host_tokens": host,
            }
        )
    elif cached:
        print(f"warm: {cached:,} of {len(tokens):,} token(s) cached, {host:,} in the host tier, at {address}")
    else:
        print(f"nothing holds this prefix at {address}", file=sys.stderr)
    return 0 if cached else 1

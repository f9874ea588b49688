"""`prefixcache shm list | clean`: the host's prefixcache shared-memory segments, for operators.

Reads segments straight from the directory (default /dev/shm; tiers/shm.py owns their
format): no service is contacted, so it works while none runs. `list` shows every
prefixcache segment with its owner record and whether that owner is alive (it holds the
segment's lock). `clean` unlinks segments whose owner is gone and never a live one: a live
segment named on the command line is refused with an error (exit 2). Unlinking removes only
the name; a worker still mapping the segment keeps it until it lets go.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from prefixcache.errors import ConfigError
from prefixcache.tiers.shm import (
    SHM_DIR,
    SegmentInfo,
    check_name,
    inspect_segment,
    list_segments,
    mib,
    remove_if_dead,
)

EXAMPLES = """examples:
  prefixcache shm list
  prefixcache shm list --json | jq '.[] | select(.alive | not) | .name'
  prefixcache shm clean                                   # every segment whose service is gone
  prefixcache shm clean prefixcache-0.0.0.0-50051         # that one, refused while its service runs
  prefixcache shm list --dir /proc/$(pidof -s prefixcache)/root/dev/shm   # another container's /dev/shm
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "shm",
        help="list or remove the host tier's shared-memory segments on this machine",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="List the prefixcache shared-memory segments of this machine, or remove those whose "
        "service is gone (a SIGKILLed service's segment stays until then, or until a service "
        "starts on the same address). A live service's segment is never removed.",
    )
    actions = parser.add_subparsers(dest="shm_command", metavar="ACTION", required=True)
    listing = actions.add_parser("list", help="name, owner pid, alive/dead, size and resident bytes of each")
    listing.add_argument("--json", action="store_true", help="one JSON array instead of the table")
    cleaning = actions.add_parser("clean", help="remove segments whose owning service is gone")
    cleaning.add_argument("names", nargs="*", metavar="NAME", help="only these (default: every dead one)")
    for sub in (listing, cleaning):
        sub.add_argument("--dir", type=Path, default=SHM_DIR, help="where the segments are (default %(default)s)")
    parser.set_defaults(handler=run)


def _as_dict(info: SegmentInfo) -> dict:
    record = info.record
    return {
        "name": info.name,
        "pid": record.pid,
        "owner": record.owner,
        "alive": info.alive,
        "size_bytes": info.size,
        "resident_bytes": info.resident,
        "created": record.created,
    }


def _table(segments: list[SegmentInfo]) -> str:
    rows = [("NAME", "PID", "STATE", "SIZE", "RESIDENT", "OWNER")]
    rows += [
        (s.name, str(s.record.pid), "alive" if s.alive else "dead", mib(s.size), mib(s.resident), s.record.owner or "-")
        for s in segments
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def run(args: argparse.Namespace) -> int:
    if args.shm_command == "list":
        segments = list_segments(args.dir)
        print(json.dumps([_as_dict(s) for s in segments], indent=2) if args.json else _table(segments))
        return 0
    return _clean(args.dir, args.names)


def _clean(directory: Path, names: list[str]) -> int:
    if names:
        targets = []
        for name in names:
            info = inspect_segment(directory / check_name(name, "name"))
            if info is None:
                raise ConfigError("name", f"{directory / name} is not a prefixcache segment (or does not exist)")
            if info.alive:
                raise ConfigError(
                    "name",
                    f"{info.path} belongs to a running service (pid {info.record.pid}); stop that service instead",
                )
            targets.append(info)
    else:
        targets = [info for info in list_segments(directory) if not info.alive]
    removed = 0
    for info in targets:
        try:
            if remove_if_dead(info.path) is not None:
                removed += 1
                print(f"removed {info.name} (pid {info.record.pid} gone, {mib(info.resident)} resident)")
        except ConfigError as error:  # came alive since it was listed: a service claimed the name
            print(f"kept {info.name}: {error}", file=sys.stderr)
    live = sum(1 for info in list_segments(directory) if info.alive)
    print(f"{removed} segment(s) removed; {live} live segment(s) kept")
    return 0

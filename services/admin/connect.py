"""From `--cache/--auth-token/--tls*` flags to a `CacheClient`, and its errors to one line.

Owns the connection flags every admin command shares, the address check, where
the bearer token comes from (flag, file, or env PREFIXCACHE_AUTH_TOKEN), and the
translation of the client's typed errors into `AdminError`s that say what went
wrong and what to do.

Invariants:
- The token is never printed, logged or put into an error message.
- Every failure leaving `connect()` is a `PrefixCacheError` subclass whose
  message is one line (services/cli.py prints it and exits 2, no traceback).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager

from prefixcache.client import CacheClient, CacheUnavailable, PermissionDenied, Unauthenticated
from prefixcache.config import parse_duration
from prefixcache.errors import InvalidArgument, PrefixCacheError

TOKEN_ENV = "PREFIXCACHE_AUTH_TOKEN"
DEFAULT_ADDRESS = "127.0.0.1:50051"
_HOST_PORT = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


class AdminError(PrefixCacheError):
    """A command failed for a reason the operator can act on; the message is one line."""

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connection")
    group.add_argument(
        "--cache",
        default=DEFAULT_ADDRESS,
        metavar="HOST:PORT",
        help="address of the cache service (default %(default)s; IPv6 as [::1]:PORT)",
    )
    token = group.add_mutually_exclusive_group()
    token.add_argument(
        "--auth-token", default=None, metavar="TOKEN", help=f"bearer token of the service (default: env {TOKEN_ENV})"
    )
    token.add_argument("--auth-token-file", default=None, metavar="FILE", help="file holding the bearer token")
    group.add_argument(
        "--timeout", default="5s", metavar="DURATION", help="deadline of each call to the service (default %(default)s)"
    )
    group.add_argument("--tls", action="store_true", help="connect with TLS (system root certificates)")
    group.add_argument(
        "--tls-ca", default=None, metavar="FILE", help="PEM root certificate(s) to trust (implies --tls)"
    )


def check_address(value: str) -> str:
    """`value` stripped, if it is HOST:PORT with a port in 1..65535; else an AdminError naming it."""
    address = value.strip()
    match = _HOST_PORT.match(address)
    if not match or not 0 < int(match.group(1)) < 65536:
        raise AdminError(f"--cache: expected HOST:PORT (IPv6 as [::1]:PORT), got {value!r}")
    return address


def auth_token(args: argparse.Namespace) -> str | None:
    if args.auth_token_file:
        try:
            with open(args.auth_token_file, encoding="utf-8") as handle:
                token = handle.read().strip()
        except OSError as error:
            raise AdminError(f"--auth-token-file: cannot read {args.auth_token_file!r}: {error.strerror}") from None
        if not token:
            raise AdminError(f"--auth-token-file: {args.auth_token_file!r} is empty")
        return token
    given = args.auth_token if args.auth_token is not None else os.environ.get(TOKEN_ENV)
    return given or None


def describe(error: PrefixCacheError, address: str, token_given: bool) -> AdminError:
    """The one-line, actionable form of a client error."""
    if isinstance(error, AdminError):
        return error
    if isinstance(error, CacheUnavailable):
        detail = str(error).removeprefix(f"cache service {address}: ")
        return AdminError(f"cannot reach the cache service at {address}: {detail}")
    if isinstance(error, Unauthenticated):
        hint = (
            "the token given was not accepted"
            if token_given
            else f"it needs a token: pass --auth-token or set {TOKEN_ENV}"
        )
        return AdminError(f"the cache service at {address} refused the call ({error}); {hint}")
    if isinstance(error, PermissionDenied):
        return AdminError(f"the cache service at {address} refused the call ({error}); this needs an admin token")
    if isinstance(error, InvalidArgument):
        return AdminError(str(error))  # already "field: what is wrong"
    return AdminError(f"{type(error).__name__}: {error}")


@contextmanager
def connect(args: argparse.Namespace) -> Iterator[CacheClient]:
    """A client for the flags in `args`; client errors leave as one-line `AdminError`s."""
    address = check_address(args.cache)
    timeout_s = parse_duration(args.timeout, "--timeout")
    if timeout_s <= 0:
        raise AdminError(f"--timeout: must be > 0, got {args.timeout!r}")
    if args.tls_ca and not os.path.isfile(args.tls_ca):
        raise AdminError(f"--tls-ca: no such file {args.tls_ca!r}")
    token = auth_token(args)
    client = CacheClient(address, auth_token=token, timeout_s=timeout_s, tls=args.tls, tls_root_cert_file=args.tls_ca)
    try:
        yield client
    except PrefixCacheError as error:
        raise describe(error, address, token is not None) from None
    finally:
        client.close()

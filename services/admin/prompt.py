"""A prompt's token ids and namespace, exactly as the reference worker would compute them.

Owns:
- `--text` (tokenized with the worker's tokenizer: cl100k for `tiny`, the
  checkpoint's own otherwise), `--chat` (the text as one user message through the
  worker's chat template, ending with the assistant header) and `--tokens-file`
  (a JSON list of ints, or ints separated by whitespace or commas);
- the namespace: `--namespace ID` as given, else the one the worker's identity
  (`--model`, `--dtype`, `--seed`, `--block-size`) attaches to.

Invariants:
- The tiny model's tokenizer is loaded without building the model, but the
  namespace always needs the weights digest, so deriving it loads the model
  (seconds for tiny); `--namespace` avoids that.
- Deriving a namespace never creates the cache: on a service no worker has
  attached to, it answers None instead of calling Attach (the first Attach
  would fix the service's KV layout). Attach is idempotent and uses
  `same_host=False`, so no shared memory is mapped into this process.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from prefixcache.client import CacheClient, ServiceStats
from prefixcache.config import MODEL_DTYPES, KVLayout

from .connect import AdminError

log = logging.getLogger(__name__)

TINY = "tiny"
_SEPARATORS = re.compile(r"[\s,]+")


@dataclass(frozen=True)
class WorkerIdentity:
    model_id: str
    revision: str
    layout: KVLayout


def add_prompt_arguments(parser: argparse.ArgumentParser, flag: str, what: str) -> None:
    source = parser.add_mutually_exclusive_group(required=flag == "--text")
    source.add_argument(flag, default=None, metavar="TEXT", help=f"{what} as text, tokenized like the worker does")
    tokens_flag = "--tokens-file" if flag == "--text" else "--prefix-tokens-file"
    source.add_argument(
        tokens_flag,
        default=None,
        metavar="FILE",
        help="token ids: a JSON list, or ints separated by spaces, commas or newlines ('-': stdin)",
    )
    parser.add_argument(
        "--chat", action="store_true", help=f"render {flag} as one user message with the worker's chat template"
    )


def add_identity_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("namespace (give --namespace, or the worker's settings to derive it)")
    group.add_argument("--namespace", default=None, metavar="ID", help="namespace id (printed by `inspect`)")
    group.add_argument(
        "--model", default=TINY, help="the worker's --model: 'tiny' or a checkpoint directory (default %(default)s)"
    )
    group.add_argument(
        "--dtype",
        default="bfloat16",
        choices=[d.value for d in MODEL_DTYPES],
        help="the worker's --dtype (default %(default)s)",
    )
    group.add_argument("--seed", type=int, default=0, help="the worker's --seed of the tiny model (default 0)")
    group.add_argument("--block-size", type=int, default=16, help="the worker's --block-size (default 16)")
    group.add_argument("--cache-salt", default=None, metavar="SALT", help="the requests' cache_salt, if any")


_DECIMAL = re.compile(r"^[0-9]+$")


def _as_token(value: object) -> int | None:
    """A token id from a JSON int or a decimal string; None for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value >= 0 else None
    if isinstance(value, str) and _DECIMAL.match(value):
        return int(value)
    return None


def read_tokens_file(path: str) -> list[int]:
    """Token ids from `path` ('-': stdin): a JSON list of ints, or ints separated by spaces/commas."""
    if path == "-":
        text = sys.stdin.read()
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise AdminError(f"tokens file {path!r}: cannot read it ({error})") from None
    text = text.strip()
    if text.startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise AdminError(f"tokens file {path!r}: invalid JSON ({error})") from None
        if not isinstance(values, list) or any(isinstance(v, str) for v in values):
            raise AdminError(f"tokens file {path!r}: expected a JSON list of ints")
    else:
        values = [part for part in _SEPARATORS.split(text) if part]
    tokens = []
    for position, value in enumerate(values):
        token = _as_token(value)
        if token is None:
            raise AdminError(f"tokens file {path!r}: item {position} is {value!r}, not a token id (an int >= 0)")
        tokens.append(token)
    return tokens


def _tokenizer_and_chat(model: str):
    """(encode, render one user message): the worker's tokenizer and template, without the weights."""
    from ..worker.chat import ChatMessage, ChatMLTemplate, ChatRenderer, HFChatTemplate, Role
    from ..worker.tokenizer import HFTokenizer, TiktokenTokenizer, Tokenizer

    tokenizer: Tokenizer
    render: ChatRenderer | None
    if model == TINY:
        tokenizer = TiktokenTokenizer()
        render = ChatMLTemplate(tokenizer).render
    else:
        if not Path(model).is_dir():
            raise AdminError(f"--model {model!r} is neither {TINY!r} nor a local checkpoint directory")
        hf = HFTokenizer(model)
        tokenizer = hf
        render = HFChatTemplate(hf).render if hf.hf.chat_template else None

    def render_user(text: str) -> list[int]:
        if render is None:
            raise ValueError("the checkpoint's tokenizer has no chat_template; drop --chat")
        return render([ChatMessage(Role.USER, text)])

    return tokenizer.encode, render_user


def prompt_tokens(args: argparse.Namespace, text: str | None, tokens_file: str | None) -> list[int]:
    if tokens_file is not None:
        if args.chat:
            raise AdminError("--chat applies to text, not to a tokens file")
        return read_tokens_file(tokens_file)
    encode, render_user = _tokenizer_and_chat(args.model)
    try:
        return render_user(text) if args.chat else encode(text)
    except ValueError as error:
        raise AdminError(f"cannot render the prompt with {args.model!r}: {error}") from None


def _load(spec: str, dtype: str, seed: int):
    from ..worker.model import load_model

    try:
        return load_model(spec, dtype=dtype, seed=seed)
    except (ValueError, OSError) as error:
        raise AdminError(f"--model {spec!r}: {error}") from None


def worker_identity(args: argparse.Namespace) -> WorkerIdentity:
    """What the worker started with these settings attaches as (loads the model for its digest)."""
    loaded = _load(args.model, args.dtype, args.seed)
    kv = loaded.kv
    layout = KVLayout(kv.layers, kv.kv_heads, kv.head_dim, args.block_size, kv.dtype)
    return WorkerIdentity(loaded.model_id, loaded.weights_digest, layout)


def _describe_layout(layout: KVLayout) -> str:
    return (
        f"{layout.layers} layers x {layout.kv_heads} kv heads x {layout.head_dim}, {layout.dtype.value}, "
        f"block {layout.block_size}"
    )


def check_layout(cached: KVLayout | None, identity: WorkerIdentity, args: argparse.Namespace) -> None:
    """An AdminError unless the worker settings give the layout the cache holds."""
    if cached is not None and cached != identity.layout:
        raise AdminError(
            f"the cache holds KV of layout ({_describe_layout(cached)}) but --model {args.model} "
            f"--dtype {args.dtype} --block-size {args.block_size} gives "
            f"({_describe_layout(identity.layout)}); pass the worker's settings or --namespace"
        )


def resolve_namespace(
    args: argparse.Namespace, client: CacheClient, stats: ServiceStats
) -> tuple[str | None, WorkerIdentity | None]:
    """(namespace id, the identity it was derived from); (None, identity) when the cache is empty."""
    if args.namespace:
        return args.namespace, None
    identity = worker_identity(args)
    if not stats.ready:
        return None, identity
    check_layout(stats.layout, identity, args)
    attachment = client.attach(identity.model_id, identity.layout, revision=identity.revision, same_host=False)
    log.debug("namespace %s for %s@%s", attachment.namespace_id, identity.model_id, identity.revision[:12])
    return attachment.namespace_id, identity

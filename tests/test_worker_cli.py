"""`prefixcache worker` refuses a model it cannot cache, or cannot find, in one clear line.

A checkpoint whose KV is not plain per-layer keys and values (sliding-window layers, hybrid
linear-attention layers) is refused before any weight is read: the command exits 2 with a
message naming the reason, never a traceback. (The per-config rules are tested in
test_worker_engine.py; this is the command's behaviour.)
"""

from __future__ import annotations

import pytest
from transformers import MistralConfig, Qwen3NextConfig

from prefixcache_services.cli import main

pytestmark = pytest.mark.unit

SMALL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=1000,
)


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (MistralConfig(sliding_window=64, **SMALL), "sliding_window=64"),
        (Qwen3NextConfig(**SMALL), "linear_attention"),
    ],
    ids=["sliding-window", "hybrid"],
)
def test_a_model_without_plain_kv_is_refused_with_one_line(tmp_path, capsys, config, reason):
    config.save_pretrained(tmp_path)  # a config alone: the refusal comes before tokenizer and weights
    code = main(["worker", "--no-cache", "--model", str(tmp_path), "--listen", "127.0.0.1:18999"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"prefixcache worker: error: model: {tmp_path} cannot use the prefix cache" in err
    assert reason in err and "Traceback" not in err


def test_an_unknown_model_spec_is_refused_with_one_line(tmp_path, capsys):
    code = main(["worker", "--no-cache", "--model", str(tmp_path / "missing"), "--listen", "127.0.0.1:18999"])
    err = capsys.readouterr().err
    assert code == 2 and "neither 'tiny' nor a local checkpoint directory" in err and "Traceback" not in err

"""``tnlg checkpoint info --verify`` reads every file of a checkpoint against the SHA-256 its manifest records: a
shard with a flipped byte (its size unchanged, which the summary alone cannot see) is one paragraph naming the
file and a non-zero exit."""

from __future__ import annotations

import hashlib
import json
import os

from tests.fresh_checkpoint import fresh_checkpoint
from tnlg.cli import main
from tnlg.config import GPTConfig


def test_verify_names_a_corrupted_shard(tmp_path, capsys):
    cfg = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=96)
    iter_dir = fresh_checkpoint(str(tmp_path / "ck"), cfg)
    with open(os.path.join(iter_dir, "meta.json")) as f:
        sums = json.load(f)["sha256"]
    for name, digest in sums.items():  # the recorded checksums are the files' SHA-256 (hashlib's)
        with open(os.path.join(iter_dir, name), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == digest
    assert main(["checkpoint", "info", str(tmp_path / "ck"), "--verify"]) == 0
    assert f"verified     {len(sums)} file(s) match" in capsys.readouterr().out
    shard = sorted(n for n in sums if n.startswith("model"))[0]
    path = os.path.join(iter_dir, shard)
    with open(path, "r+b") as f:  # one byte flipped in the middle: same size
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))
    assert main(["checkpoint", "info", str(tmp_path / "ck")]) == 0  # the summary reads the manifest alone
    capsys.readouterr()
    assert main(["checkpoint", "info", str(tmp_path / "ck"), "--verify"]) != 0
    err = capsys.readouterr().err.strip()
    assert shard in err and "SHA-256" in err and "\n" not in err.rstrip() and "Traceback" not in err
    assert main(["checkpoint", "info", str(tmp_path / "ck"), "--verify", "--json"]) != 0
    assert shard in capsys.readouterr().err

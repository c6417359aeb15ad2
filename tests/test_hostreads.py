"""The host-read counter (attnkit.bench.hostreads) and the script that reports per-call counts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from attnkit.bench.hostreads import HostReads

REPO = Path(__file__).resolve().parents[1]


def test_counts_each_kind_of_value_read():
    t = torch.tensor([1, 0, 2])
    with HostReads() as reads:
        t.sum().item()
        bool(t.any())
        int(t[0])
        t.tolist()
        t.numpy()
        t.nonzero()
        t[t > 0]
        u = t.clone()
        u[u > 0] = 5
        torch.equal(t, t)
        t.repeat_interleave(t)
    assert dict(reads.by_kind) == {"item": 3, "tolist": 1, "numpy": 1, "nonzero": 1,
                                   "bool_index": 2, "equal": 1, "repeat_interleave": 1}


def test_device_side_work_is_not_counted_and_the_patches_are_undone():
    t = torch.tensor([1.0, 0.0, 2.0])
    with HostReads() as reads:
        (t * 2 + 1).softmax(0)
        t[torch.tensor([0, 2])]  # integer indices: no read
        t.repeat_interleave(torch.tensor([1, 2, 1]), output_size=4)
        torch.where(t > 0, t, 0.0)
    assert reads.count == 0
    original_tolist = torch.Tensor.tolist
    with HostReads():
        pass
    assert torch.Tensor.tolist is original_tolist


def test_the_report_script_writes_every_row(tmp_path):
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "hostreads.py"), "--out",
                    str(tmp_path)], check=True, capture_output=True, timeout=600,
                   env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    saved = json.loads((tmp_path / "hostreads.json").read_text())
    assert set(saved["calls"]) - {"triton"} == {"auto", "tiled"}
    assert {"padding(kv_lengths)", "documents(causal)", "causal & alibi"} <= set(saved["calls"]["auto"])
    for row in saved["calls"]["auto"].values():
        assert row["first"] >= row["repeated"] >= 0
    assert saved["mha_decode_step"] > 0

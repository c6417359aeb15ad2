"""``benchmarks/field.py --quick`` end to end: every comparison passes its equality check
(hidden states, generated tokens) and lands in the JSON with its figures."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def test_field_script_reports_every_row(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("field_script", REPO / "benchmarks" / "field.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setenv("OUT", str(tmp_path))
    threads = torch.get_num_threads()
    try:
        assert script.main(["--quick"]) == 0
    finally:
        torch.set_num_threads(threads)
    data = json.loads((tmp_path / "field_quick.json").read_text())

    rows = ["ragged decode", "GQA decoding step", "GQA decoding step", "tiny call fwd",
            "tiny call fwd+bwd"]
    reads = ["ragged decode step"]
    if importlib.util.find_spec("transformers") is not None:  # the rows that need transformers
        rows += ["Llama generate left-padded", "Llama generate equal lengths", "MiniLM-L6 forward"]
        reads += ["Llama decode step left-padded"]
        assert data["transformers"]
    assert sorted(r["case"].split(",")[0] for r in data["rows"]) == sorted(rows)
    for r in data["rows"]:
        assert r["attnkit"] > 0 and r["sdpa"] > 0 and r["ratio"] > 0, r
    assert sorted(r["case"].split(",")[0] for r in data["host_reads"]) == sorted(reads)
    for r in data["host_reads"]:  # counts: 0 is a valid figure
        assert isinstance(r["attnkit"], int) and r["attnkit"] >= 0, r
        assert isinstance(r["sdpa"], int) and r["sdpa"] >= 0, r
    assert data["threads"] == 1 and data["torch"] == torch.__version__ and data["date"]

"""Host reads per call, counted on CPU (the proxy for device syncs on CUDA).

    PYTHONPATH=src python benchmarks/hostreads.py        # table; JSON to $OUT or results/

For every mask kind and score modifier: the reads of the first call with a new mask
(validation, planning) and of a repeated call with the same mask (what every layer of a model
pays), on ``auto``, ``tiled`` and, where triton is installed, ``triton`` (through its
interpreter on a machine without CUDA); an ``nn.MultiHeadAttention`` decode step over a
``KVCache(lengths=)``; a whole decode step of a tiny transformers Llama (2 layers) with
left-padded prompts, when transformers is installed. Counted with
:class:`attnkit.bench.hostreads.HostReads`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import importlib.util

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
TRITON = importlib.util.find_spec("triton") is not None
if TRITON and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton's import: its kernels run on CPU

import attnkit as ak  # noqa: E402
from attnkit.bench.hostreads import HostReads  # noqa: E402
from attnkit.nn import KVCache, MultiHeadAttention  # noqa: E402

B, H, T, D = 2, 4, 64, 16


def masks() -> dict:
    """Fresh masks, one per kind (new tensors each time: a first call plans anew)."""
    lengths = torch.tensor([64, 40])
    ids = torch.arange(T) // 16
    return {
        "none": None,
        "causal": ak.causal(),
        "sliding_window(8)": ak.sliding_window(8),
        "padding(kv_lengths)": ak.padding(kv_lengths=lengths.clone()),
        "causal & padding": ak.causal() & ak.padding(kv_lengths=lengths.clone()),
        "causal(sequences=padding)": ak.causal("bottom_right", sequences=ak.padding(
            q_lengths=lengths.clone(), kv_lengths=lengths.clone())),
        "documents": ak.documents(ids.clone()),
        "documents(causal)": ak.documents(ids.clone(), causal="top_left"),
        "documents & causal": ak.documents(ids.clone()) & ak.causal(),
        "dense": ak.dense(torch.ones(T, T, dtype=torch.bool).tril()),
        "causal & softcap": ak.causal() & ak.softcap(30.0),
        "causal & alibi": ak.causal() & ak.alibi(2.0 ** -torch.arange(1.0, H + 1)),
        "causal & relative_bias": ak.causal() & ak.relative_bias(torch.randn(H, 32)),
        "causal & sinks": ak.causal() & ak.sinks(torch.zeros(H)),
    }


def count(fn) -> int:
    with HostReads() as reads:
        fn()
    return reads.count


def per_call(backend: str) -> dict:
    q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
    rows = {}
    for name in masks():
        mask = masks()[name]
        call = lambda: ak.attention(q, k, v, mask, backend=backend)  # noqa: E731
        first = count(call)
        rows[name] = {"first": first, "repeated": count(call)}
    return rows


def mha_decode_step() -> int:
    torch.manual_seed(0)
    mha = MultiHeadAttention(64, 4)
    prompt = torch.randn(3, 8, 64)
    lengths = torch.tensor([8, 5, 2])
    out = mha(prompt, is_causal=True, cache=KVCache.empty(), lengths=lengths)
    cache = out.cache
    step = torch.randn(3, 1, 64)
    mha(step, is_causal=True, cache=cache, lengths=torch.ones(3, dtype=torch.long))  # warm
    return count(lambda: mha(step, is_causal=True, cache=cache,
                             lengths=torch.ones(3, dtype=torch.long)))


def transformers_decode_step():
    try:
        import transformers
    except ImportError:
        return None
    import attnkit.integrations.transformers as akhf

    akhf.register()
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=100, max_position_embeddings=128, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="attnkit")
    model.eval()
    ids = torch.randint(3, 100, (3, 10))
    attention = torch.ones(3, 10, dtype=torch.long)
    attention[1, :4] = 0  # left padding
    attention[2, :7] = 0
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=attention, use_cache=True)
        cache, nxt = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
        attention = torch.cat([attention, torch.ones(3, 1, dtype=torch.long)], 1)
        return count(lambda: model(input_ids=nxt, attention_mask=attention,
                                   cache=cache, use_cache=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    backends = ("auto", "tiled", "triton") if TRITON else ("auto", "tiled")
    results = {"calls": {backend: per_call(backend) for backend in backends},
               "mha_decode_step": mha_decode_step(),
               "transformers_decode_step": transformers_decode_step()}
    print(f"host reads per call (B{B} H{H} T{T} D{D}): first call with a new mask / repeated")
    print(f"{'mask':28s}" + "".join(f" {backend:>12s}" for backend in backends))
    for name in results["calls"]["auto"]:
        cells = [f"{r[name]['first']:>5d} / {r[name]['repeated']:<4d}"
                 for r in results["calls"].values()]
        print(f"{name:28s}" + "".join(f" {cell:>12s}" for cell in cells))
    print(f"MultiHeadAttention decode step, KVCache(lengths=): {results['mha_decode_step']}")
    print(f"transformers tiny Llama (2 layers) decode step, left-padded: "
          f"{results['transformers_decode_step']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hostreads.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""attnkit where a user meets it, against what that user would write on torch SDPA instead.

    PYTHONPATH=src python benchmarks/field.py            # table; JSON to $OUT or results/
    PYTHONPATH=src python benchmarks/field.py --quick    # a smoke run: the figures mean nothing
    PYTHONPATH=src python benchmarks/field.py --device cuda  # the decode loop and tiny call on a GPU

- **Ragged batched decode**: 8 prompts of 2..60 tokens, right-padded, then 128 decode steps,
  through a 4-layer model (E 256, 4 heads, pre-norm, no MLP): ``nn.MultiHeadAttention`` with a
  ``KVCache(capacity=)`` fed per-sequence ``lengths=``, against the same weights in a loop on
  ``F.scaled_dot_product_attention`` over a preallocated right-padded cache written in place,
  with a bool key mask ``[B, 1, 1, T]`` built from the lengths each step. ms per forward pass
  (prefill included).
- **transformers Llama ``generate``** (random weights, 4 layers, hidden 256, GQA 4/2 heads):
  ``attn_implementation="attnkit"`` against ``"sdpa"``, greedy, 64 new tokens for 4 prompts,
  left-padded prompts of different lengths and unpadded equal-length prompts. ms per token.
- **MiniLM-L6-shaped BERT forward** (random weights): batch 32, lengths 8..128 padded to the
  longest, ``attnkit`` against ``sdpa``. ms per forward.
- **GQA decoding step** B4 Hq32 Hkv8 D128 over a cache of 2048 keys: ``attnkit.attention``
  against ``F.scaled_dot_product_attention(..., enable_gqa=True)``, every key real, and ragged
  (512..2048 real keys: ``padding(kv_lengths=)`` against a bool key mask). µs per step.
- **Tiny call** B1 H1 T16 D64: ``attnkit.attention`` against ``F.scaled_dot_product_attention``,
  forward and forward+backward. µs per call.
- **Host reads** (:class:`attnkit.bench.hostreads.HostReads`, the CPU proxy for device syncs)
  in one decode step of the ragged model (all layers) and of the Llama model (left-padded).

Each pair is checked to compute the same thing first (hidden states, generated tokens), then
timed interleaved, block by block, and the medians compared. One CPU thread
(``torch.set_num_threads(1)``). The transformers rows need transformers installed.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import attnkit as ak  # noqa: E402
from attnkit.bench.hostreads import HostReads  # noqa: E402
from attnkit.bench.runner import interleaved  # noqa: E402
from attnkit.nn import KVCache, MultiHeadAttention  # noqa: E402

try:
    import transformers
except ImportError:
    transformers = None

PROMPT_LENGTHS = [2, 9, 17, 25, 33, 41, 50, 60]


def row(case: str, unit: str, seconds: dict[str, float], scale: float) -> dict:
    """A table row: the medians in ``unit`` (seconds × ``scale``) and attnkit / SDPA."""
    return dict(case=case, unit=unit, attnkit=seconds["attnkit"] * scale,
                sdpa=seconds["sdpa"] * scale, ratio=seconds["attnkit"] / seconds["sdpa"])


# ---- 1. ragged batched decode ------------------------------------------------------------------
Layers = list[tuple[torch.nn.LayerNorm, MultiHeadAttention]]


class AttnkitDecode:
    """The model on ``MultiHeadAttention`` with one ``KVCache`` per layer; the constructor
    prefills the right-padded ``prompt [B, T, E]`` whose sequence b holds ``lengths[b]`` tokens."""

    def __init__(self, layers: Layers, prompt: torch.Tensor, lengths: torch.Tensor, capacity: int):
        self.layers = layers
        self.caches = [KVCache.empty(capacity) for _ in layers]
        self.prefilled = self._forward(prompt, lengths)

    def _forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        for i, (norm, mha) in enumerate(self.layers):
            out, _, self.caches[i] = mha(norm(x), cache=self.caches[i], is_causal=True,
                                         lengths=lengths)
            x = x + out  # [B, t, E]
        return x

    def step(self, x: torch.Tensor) -> torch.Tensor:
        """One new token per sequence (every new position real: no ``lengths``):
        ``x [B, 1, E]`` → hidden states ``[B, 1, E]``."""
        return self._forward(x, None)


class SdpaDecode:
    """The same model by hand on SDPA: per layer a right-padded cache ``[B, H, capacity, D]``
    written in place, sequence b's tokens at ``[0, lengths[b])``, and a bool key mask."""

    def __init__(self, layers: Layers, prompt: torch.Tensor, lengths: torch.Tensor, capacity: int):
        mha, (batch, width, _) = layers[0][1], prompt.shape
        shape = (batch, mha.num_kv_heads, capacity, mha.head_dim)
        device = prompt.device
        self.layers, self.rows = layers, torch.arange(batch, device=device)
        self.keys = [torch.zeros(shape, device=device) for _ in layers]
        self.values = [torch.zeros(shape, device=device) for _ in layers]
        self.lengths, self.span = lengths.clone(), width  # [B]; cache positions attended
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()  # [T, T]
        real_keys = torch.arange(width, device=device) < lengths[:, None]  # [B, T]
        x = prompt
        for i, (norm, mha) in enumerate(layers):
            q, k, v = self._project(mha, norm(x))
            self.keys[i][:, :, :width], self.values[i][:, :, :width] = k, v
            mask = causal & real_keys[:, None, None, :]  # [B, 1, T, T]
            x = x + self._attend(mha, q, k, v, mask)
        self.prefilled = x

    @staticmethod
    def _project(mha: MultiHeadAttention, x: torch.Tensor):
        q = mha.q_proj(x).unflatten(-1, (mha.num_heads, mha.head_dim)).transpose(1, 2)  # [B, H, t, D]
        k = mha.k_proj(x).unflatten(-1, (mha.num_kv_heads, mha.head_dim)).transpose(1, 2)
        v = mha.v_proj(x).unflatten(-1, (mha.num_kv_heads, mha.head_dim)).transpose(1, 2)
        return q, k, v

    @staticmethod
    def _attend(mha, q, k, v, mask) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, t, D]
        return mha.out_proj(out.transpose(1, 2).flatten(-2))  # [B, t, E]

    def step(self, x: torch.Tensor) -> torch.Tensor:
        """One new token per sequence, written at ``lengths[b]``: ``[B, 1, E]`` → ``[B, 1, E]``."""
        position, self.span = self.lengths, self.span + 1
        positions = torch.arange(self.span, device=position.device)
        mask = (positions <= position[:, None])[:, None, None, :]  # [B, 1, 1, T]
        for i, (norm, mha) in enumerate(self.layers):
            q, k, v = self._project(mha, norm(x))
            self.keys[i][self.rows, :, position] = k[:, :, 0]  # [B, H, D]
            self.values[i][self.rows, :, position] = v[:, :, 0]
            x = x + self._attend(mha, q, self.keys[i][:, :, :self.span],
                                 self.values[i][:, :, :self.span], mask)
        self.lengths = position + 1
        return x


class RaggedWorkload(NamedTuple):
    """The ragged decode's model and inputs (also timed by ``benchmarks/invariance.py``)."""

    layers: Layers
    prompt: torch.Tensor  # [B, T, E], right-padded
    lengths: torch.Tensor  # [B]
    tokens: torch.Tensor  # [B, steps + 2, E]: one input per step
    capacity: int
    steps: int
    embed: int


def ragged_workload(quick: bool, device: str = "cpu") -> RaggedWorkload:
    """4 layers of E 256, 8 prompts of :data:`PROMPT_LENGTHS`, 128 steps (4 when ``quick``)."""
    torch.manual_seed(0)
    embed, steps = 256, 4 if quick else 128
    layers = [(torch.nn.LayerNorm(embed, device=device),
               MultiHeadAttention(embed, 4, device=device)) for _ in range(4)]
    lengths = torch.tensor(PROMPT_LENGTHS, device=device)
    prompt = torch.randn(len(lengths), max(PROMPT_LENGTHS), embed, device=device)
    tokens = torch.randn(len(lengths), steps + 2, embed, device=device)
    return RaggedWorkload(layers, prompt, lengths, tokens, max(PROMPT_LENGTHS) + steps + 2, steps,
                          embed)


def ragged_decode(quick: bool, device: str = "cpu") -> tuple[dict, dict]:
    """(timing row, host reads of one decode step) of the ragged decode, outputs checked first."""
    layers, prompt, lengths, tokens, capacity, steps, embed = ragged_workload(quick, device)
    kinds = {"attnkit": AttnkitDecode, "sdpa": SdpaDecode}

    def decode(kind) -> torch.Tensor:
        model = kind(layers, prompt, lengths, capacity)
        out = torch.cat([model.step(tokens[:, s:s + 1]) for s in range(steps)], 1)  # [B, steps, E]
        if out.is_cuda:
            torch.cuda.synchronize()  # the time of the work, not of queueing it
        return out

    with torch.no_grad():
        torch.testing.assert_close(decode(AttnkitDecode), decode(SdpaDecode), rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"ragged decode: attnkit and SDPA differ\n{m}")
        seconds = interleaved({name: lambda k=kind: decode(k) for name, kind in kinds.items()},
                              calls=1, blocks=2 if quick else 7)
        reads = {}
        for name, kind in kinds.items():
            model = kind(layers, prompt, lengths, capacity)
            model.step(tokens[:, :1])  # warm-up step
            with HostReads() as counted:
                model.step(tokens[:, 1:2])
            reads[name] = counted.count
    case = f"ragged decode, B8 prompts 2..60, {steps} steps, 4 layers E{embed}, {device}"
    return (row(case, "ms/token", seconds, 1e3 / (steps + 1)),
            dict(case="ragged decode step, 4 layers", **reads))


# ---- 2, 3. transformers -------------------------------------------------------------------------
def twin_models(auto, config) -> dict:
    """``{"sdpa": model, "attnkit": model}`` built from ``config``, with the same weights."""
    models = {}
    for impl in ("sdpa", "attnkit"):  # a config copy each: from_config sets the implementation
        torch.manual_seed(0)
        models[impl] = auto.from_config(copy.deepcopy(config), attn_implementation=impl).eval()
    models["attnkit"].load_state_dict(models["sdpa"].state_dict())
    return models


def left_padded(lengths: list[int], vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention_mask ``[B, max(lengths)]``, padding (id 0) on the left."""
    width = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), width), generator=torch.Generator().manual_seed(seed))
    mask = (torch.arange(width) >= width - torch.tensor(lengths)[:, None]).long()  # [B, T]
    return ids * mask, mask


def llama_generate(quick: bool) -> tuple[list[dict], dict]:
    """(timing rows, host reads of one decode step) of greedy ``generate``, tokens checked first."""
    # initializer_range 0.2 keeps the logits far from uniform: greedy choices do not hinge on
    # rounding differences between two correct attention implementations.
    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256,
        initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    models = twin_models(transformers.AutoModelForCausalLM, config)
    new = 4 if quick else 64
    rows, prompts = [], {"left-padded": [8, 16, 24, 32], "equal lengths": [32] * 4}
    for case, lengths in prompts.items():
        ids, mask = left_padded(lengths, config.vocab_size, seed=1)
        runs = {impl: lambda m=m: m.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                             max_new_tokens=new, min_new_tokens=new)
                for impl, m in models.items()}
        tokens = {impl: run() for impl, run in runs.items()}
        if not torch.equal(tokens["attnkit"], tokens["sdpa"]):
            raise AssertionError(f"Llama generate ({case}): attnkit and sdpa generated different "
                                 f"tokens\nattnkit {tokens['attnkit']}\nsdpa {tokens['sdpa']}")
        seconds = interleaved(runs, calls=1, blocks=2 if quick else 7)
        rows.append(row(f"Llama generate {case}, B4 {new} tokens", "ms/token", seconds, 1e3 / new))
    ids, mask = left_padded(prompts["left-padded"], config.vocab_size, seed=1)
    return rows, dict(case="Llama decode step left-padded, 4 layers",
                      **{impl: llama_step_reads(m, ids, mask) for impl, m in models.items()})


def llama_step_reads(model, ids: torch.Tensor, mask: torch.Tensor) -> int:
    """Host reads of one forward call with a cache, after the prefill and one warm-up step."""
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        for _ in range(2):  # the warm-up step, then the counted one
            mask = torch.cat([mask, mask.new_ones(len(mask), 1)], 1)
            with HostReads() as reads:
                out = model(input_ids=out.logits[:, -1:].argmax(-1), attention_mask=mask,
                            cache=out.cache, use_cache=True)
    return reads.count


def minilm_forward(quick: bool) -> dict:
    """Timing row of a padded batch through a MiniLM-L6-shaped BERT, outputs checked first."""
    config = transformers.BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                                     intermediate_size=1536)
    models = twin_models(transformers.AutoModel, config)
    batch, longest = (4, 32) if quick else (32, 128)
    lengths = torch.linspace(8, longest, batch).round().long()  # [B]
    ids = torch.randint(1000, config.vocab_size, (batch, longest),
                        generator=torch.Generator().manual_seed(2))
    mask = (torch.arange(longest) < lengths[:, None]).long()  # [B, T], right padding
    ids = ids * mask
    runs = {impl: lambda m=m: m(input_ids=ids, attention_mask=mask) for impl, m in models.items()}
    with torch.no_grad():
        hidden = {impl: run().last_hidden_state[mask.bool()] for impl, run in runs.items()}
        torch.testing.assert_close(hidden["attnkit"], hidden["sdpa"], rtol=1e-5, atol=1e-4,
                                   msg=lambda m: f"MiniLM: attnkit and sdpa differ\n{m}")
        seconds = interleaved(runs, calls=1, blocks=2 if quick else 5)
    return row(f"MiniLM-L6 forward, B{batch} lengths 8..{longest}", "ms/forward", seconds, 1e3)


# ---- 4. tiny call ----------------------------------------------------------------------------------
def tiny_call(quick: bool, device: str = "cpu") -> list[dict]:
    """Timing rows of one B1 H1 T16 D64 call, forward and forward+backward."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 16, 64, generator=gen).to(device) for _ in range(3))
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        grad = mode == "fwd+bwd"
        leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)]

        def call(attend):
            out = attend(*leaves)
            if grad:
                out.sum().backward()
            if out.is_cuda:
                torch.cuda.synchronize()
        seconds = interleaved({"attnkit": lambda: call(ak.attention),
                               "sdpa": lambda: call(F.scaled_dot_product_attention)},
                              calls=4 if quick else 300, blocks=2 if quick else 9, warmup=20)
        rows.append(row(f"tiny call {mode}, B1 H1 T16 D64, {device}", "µs/call", seconds, 1e6))
    return rows


# ---- 5. GQA decoding step ------------------------------------------------------------------------
def gqa_decode_steps(quick: bool, device: str = "cpu") -> list[dict]:
    """Timing rows of one decoding step with grouped-query heads, over a full cache and over a
    ragged one (a key padding mask over a cache that holds garbage past each length), outputs
    checked first."""
    gen = torch.Generator().manual_seed(3)
    batch, heads_q, heads_kv, width, dim = (2, 8, 2, 256, 64) if quick else (4, 32, 8, 2048, 128)
    q = torch.randn(batch, heads_q, 1, dim, generator=gen).to(device)
    k, v = (torch.randn(batch, heads_kv, width, dim, generator=gen).to(device) for _ in range(2))
    lengths = torch.linspace(width // 4, width, batch).long().to(device)
    real = (torch.arange(width, device=device) < lengths[:, None])[:, None, None, :]  # [B,1,1,T]
    rows = []
    for case, mask, bool_mask in (("full", None, None),
                                  ("ragged", ak.padding(kv_lengths=lengths), real)):
        runs = {"attnkit": lambda m=mask: ak.attention(q, k, v, m),
                "sdpa": lambda m=bool_mask: F.scaled_dot_product_attention(
                    q, k, v, attn_mask=m, enable_gqa=True)}
        torch.testing.assert_close(runs["attnkit"](), runs["sdpa"](), rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"GQA decoding step: attnkit and sdpa differ\n{m}")

        def synced(run):
            out = run()
            if out.is_cuda:
                torch.cuda.synchronize()
        seconds = interleaved({name: lambda r=run: synced(r) for name, run in runs.items()},
                              calls=2 if quick else 10, blocks=2 if quick else 9, warmup=3)
        rows.append(row(f"GQA decoding step, {case} cache, B{batch} Hq{heads_q} Hkv{heads_kv} "
                        f"Tk{width} D{dim}, {device}", "µs/step", seconds, 1e6))
    return rows


# ---- report ----------------------------------------------------------------------------------------
def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps and repeats: checks the "
                        "script runs, its figures mean nothing")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "results"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the ragged decode and the tiny "
                        "call run (cuda: synchronised per timed call); the transformers rows "
                        "run on the CPU only")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    torch.set_num_threads(1)
    decode, decode_reads = ragged_decode(args.quick, args.device)
    rows, reads = [decode], [decode_reads]
    if transformers is not None and args.device == "cpu":
        import attnkit.integrations.transformers as ak_hf

        ak_hf.register()
        generate_rows, generate_reads = llama_generate(args.quick)
        rows += [*generate_rows, minilm_forward(args.quick)]
        reads.append(generate_reads)
    rows += [*gqa_decode_steps(args.quick, args.device), *tiny_call(args.quick, args.device)]

    print("| case | unit | attnkit | SDPA | attnkit / SDPA |\n|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['unit']} | {r['attnkit']:.3f} | {r['sdpa']:.3f} | "
              f"{r['ratio']:.2f}× |")
    print("\n| host reads in one decode step | attnkit | SDPA |\n|---|---:|---:|")
    for r in reads:
        print(f"| {r['case']} | {r['attnkit']} | {r['sdpa']} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "field" + ("" if args.device == "cpu" else f"_{args.device}")
    (out / (f"{name}_quick.json" if args.quick else f"{name}.json")).write_text(json.dumps(dict(
        date=datetime.datetime.now().isoformat(timespec="seconds"), machine=platform.platform(),
        processor=platform.processor(), torch=torch.__version__,
        transformers=transformers.__version__ if transformers is not None else None,
        threads=torch.get_num_threads(), device=args.device, quick=args.quick, rows=rows,
        host_reads=reads), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

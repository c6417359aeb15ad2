"""The ``attnkit`` command line: every command through ``main([...])``.

Expected numbers are computed here independently (``math.exp`` softmax, float64), never copied
from the CLI's output.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from attnkit import cli, dispatch
from attnkit.backends.base import BackendOutput
from attnkit.backends.reference import ReferenceBackend
from attnkit.cli import check as check_cmd
from attnkit.cli import explain as explain_cmd
from attnkit.cli import scale_study

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def softmax_rows(scores):
    """Row-wise softmax of a list of lists (None = masked), in plain Python floats."""
    rows = []
    for row in scores:
        visible = [s for s in row if s is not None]
        top = max(visible)
        total = sum(math.exp(s - top) for s in visible)
        rows.append([0.0 if s is None else math.exp(s - top) / total for s in row])
    return rows


def attention_by_hand(q, k, v, causal=False, scale=None):
    """softmax(q kᵀ·scale [causal]) v with Python lists: returns (weights, out)."""
    scale = 1 / math.sqrt(len(q[0])) if scale is None else scale
    scores = [[None if causal and j > i else scale * sum(a * b for a, b in zip(qi, kj))
               for j, kj in enumerate(k)] for i, qi in enumerate(q)]
    weights = softmax_rows(scores)
    out = [[sum(w * vj[c] for w, vj in zip(row, v)) for c in range(len(v[0]))] for row in weights]
    return weights, out


def assert_png(path):
    data = path.read_bytes()
    assert len(data) > 0
    assert data[:8] == PNG_SIGNATURE


# ---- explain ---------------------------------------------------------------------------------

def test_explain_default_is_the_three_token_example_step_by_step(capsys):
    assert cli.main(["explain"]) == 0
    text = capsys.readouterr().out
    example = [[1.0, 0.0], [2.0, 0.0], [3.0, 0.0]]
    weights, out = attention_by_hand(example, example, example, causal=True)
    # Row 2 by hand: softmax([3, 6, 9] / √2) ≈ [0.0127, 0.1057, 0.8816], O[2] ≈ 2.869.
    assert [f"{w:.4f}" for w in weights[2]] == ["0.0127", "0.1057", "0.8816"]
    for value in weights[2] + weights[1] + [out[1][0], out[2][0]]:
        assert f"{value:.4f}" in text
    assert "2.869" in text
    # The opening lines say what the example is and show its inputs.
    first, second = text.splitlines()[:2]
    assert "3-token example of scaled dot-product attention" in first
    assert "Q = K = V = [[1,0],[2,0],[3,0]]" in second and "causal" in second and "d_k = 2" in second
    # No comparison with numbers printed elsewhere: the computation speaks for itself.
    assert "printed" not in text.lower() and "DIFFERS" not in text


INTERNAL = re.compile(r"seed (document|doc\b|\d{3}|is wrong|printed)|seeds/|issue \d|shared/",
                      re.IGNORECASE)
"""Words that point at documents a user of the package has never seen."""


def test_user_facing_text_names_no_internal_documents(tmp_path, monkeypatch, capsys):
    """explain (plain and modified), scale-study and every --help text read on their own."""
    monkeypatch.setattr(scale_study, "D_KS", (16, 32))
    monkeypatch.setattr(scale_study, "plot_study", lambda rows, path: path)  # PNGs: tested below
    for argv in (["explain"], ["explain", "--alibi", "0.5", "--softcap", "2"],
                 ["scale-study", "--out", str(tmp_path), "--samples", "100"]):
        assert cli.main(argv) == 0
        text = capsys.readouterr().out
        assert not INTERNAL.search(text), (argv, INTERNAL.search(text))
    for argv in (["--help"], *([name, "--help"] for name in cli.COMMANDS)):
        with pytest.raises(SystemExit):
            cli.main(argv)
        text = capsys.readouterr().out
        assert "usage: attnkit" in text and not INTERNAL.search(text), (argv, INTERNAL.search(text))


def test_explain_titles_the_alibi_step_with_its_slope(capsys):
    assert cli.main(["explain", "--alibi", "0.5"]) == 0
    titles = [line for line in capsys.readouterr().out.splitlines() if "3b. Modified" in line]
    assert len(titles) == 1 and "ALiBi slope 0.5" in titles[0], titles
    assert cli.main(["explain", "--softcap", "2", "--alibi", "-0.25"]) == 0
    [title] = [line for line in capsys.readouterr().out.splitlines() if "3b. Modified" in line]
    assert "softcap 2" in title and "ALiBi slope -0.25" in title, title


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_explain_refuses_a_non_finite_alibi_slope(monkeypatch, capsys, value):
    _refuse_to_work(monkeypatch)
    assert cli.main(["explain", f"--alibi={value}"]) == 2
    assert_one_line_error(capsys, "explain", f"--alibi {value}", "finite")


def test_explain_json_inputs(capsys):
    q, k, v = [[0.5, -1.0], [2.0, 0.25]], [[1.0, 3.0], [-2.0, 0.5], [0.0, 1.5]], [[1.0], [10.0], [100.0]]
    argv = ["explain", "--q", json.dumps(q), "--k", json.dumps(k), "--v", json.dumps(v)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    weights, out = attention_by_hand(q, k, v)
    for value in [w for row in weights for w in row] + [o[0] for o in out]:
        assert f"{value:.4f}" in text
    assert "Q = K = V" not in text  # the built-in example's description: not for own inputs
    assert "no mask" in text


def test_explain_says_how_it_shows_a_non_finite_row(capsys):
    argv = ["explain", "--q", "[[1, NaN], [1, 2]]", "--k", "[[1, 0], [2, 1]]", "--causal"]
    assert cli.main(argv) == 0
    assert "holds NaN or ±inf: the steps below use it as zeros" in capsys.readouterr().out
    assert cli.main(["explain", "--q", "[[1, 0], [1, 2]]", "--k", "[[1, 0], [2, 1]]"]) == 0
    assert "NaN" not in capsys.readouterr().out


def test_explain_names_the_rows_whose_scores_overflow(capsys):
    # q_0 · k_1 = 1e400 overflows float64; the causal mask hides it, a softcap bounds it
    own = ["--q", "[[1e200, 0], [1, 0]]", "--k", "[[1, 0], [1e200, 0]]"]
    for extra, named in (([], True), (["--causal"], False), (["--softcap", "5"], False)):
        assert cli.main(["explain", *own, *extra]) == 0
        text = capsys.readouterr().out
        assert ("Row(s) 0: a score the row may attend overflowed float64" in text) == named
        assert ("nan" in text) == named


def test_explain_refuses_a_single_number(capsys):
    assert cli.main(["explain", "--q", "5"]) == 2
    assert "single number (shape ())" in capsys.readouterr().err


@pytest.mark.parametrize("scale, variance", [(None, None), (0.35, "0.245"), (-1, "2"),
                                             (0, "0")])
def test_explain_states_the_score_variance_of_its_scale(capsys, scale, variance):
    """The default 1/√d_k keeps unit variance; any other scale says what variance it gives
    (d_k = 2 in the default example)."""
    argv = ["explain"] + ([] if scale is None else [f"--scale={scale}"])
    assert cli.main(argv) == 0
    step = " ".join(capsys.readouterr().out.split("3. Scaled")[1].split())
    if variance is None:
        assert "keeps the score variance ≈ 1" in step
    else:
        assert "keeps the score variance" not in step
        assert f"scale² · d_k = {variance} " in step


def test_explain_applies_one_alibi_slope_to_every_head(tmp_path, capsys):
    rng = np.random.default_rng(4)
    q, k = rng.normal(size=(1, 4, 3, 2)), rng.normal(size=(1, 2, 3, 2))  # GQA 4/2
    for name, array in (("q", q), ("k", k)):
        np.save(tmp_path / f"{name}.npy", array)
    argv = ["explain", f"--q={tmp_path / 'q.npy'}", f"--k={tmp_path / 'k.npy'}", "--alibi", "0.5"]
    assert cli.main(argv) == 0
    assert "slope 0.5" in capsys.readouterr().out


def test_explain_npy_inputs_with_causal_and_scale(tmp_path, capsys):
    rng = np.random.default_rng(3)
    q, k, v = rng.normal(size=(4, 3)), rng.normal(size=(4, 3)), rng.normal(size=(4, 2))
    paths = {}
    for name, array in (("q", q), ("k", k), ("v", v)):
        paths[name] = tmp_path / f"{name}.npy"
        np.save(paths[name], array)
    argv = ["explain", "--causal", "--scale", "0.9"] + [f"--{n}={p}" for n, p in paths.items()]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    weights, out = attention_by_hand(q.tolist(), k.tolist(), v.tolist(), causal=True, scale=0.9)
    for value in [w for row in weights for w in row] + [o for row in out for o in row]:
        assert f"{value:.4f}" in text
    assert "-inf" in text and "█░░░" in text


@pytest.mark.parametrize("argv, words", [
    (["explain", "--plot", ""], ["--plot", ".png"]),
    (["explain", "--plot", "w.pdf"], ["--plot", ".png"]),
    (["explain", "--q", ""], ["--q", "cannot read"]),
    (["bench", "--threads", "100000"], ["--threads", "at most"]),
    (["scale-study", "--samples", "2000000000"], ["--samples", "at most"]),
])
def test_out_of_range_and_empty_arguments_are_usage_errors(argv, words, tmp_path,
                                                            monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    assert_one_line_error(capsys, argv[0], *words)


def test_explain_plot_writes_png(tmp_path, capsys):
    path = tmp_path / "sub" / "weights.png"
    assert cli.main(["explain", "--plot", str(path)]) == 0
    assert_png(path)
    assert str(path) in capsys.readouterr().out


def test_explain_rejects_bad_input(capsys):
    assert cli.main(["explain", "--q", "[[1, 0], [2"]) == 2
    assert cli.main(["explain", "--q", "[[1, 0]]", "--k", "[[1, 0, 3]]"]) == 2
    err = capsys.readouterr().err
    assert "JSON" in err and "feature dim" in err


# ---- scale-study -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def experiment_rows():
    return scale_study.experiment()


def test_example_1_variance_theory_and_estimate():
    samples, d_k = 20000, 64
    rows = {row["scale"]: row for row in scale_study.variance_example(d_k, samples, seed=1)}
    assert rows["1"]["theory_var"] == 64 and rows["1/√d_k"]["theory_var"] == 1
    assert rows["1/d_k"]["theory_var"] == pytest.approx(1 / 64)
    # qᵀk is a sum of d_k products of N(0,1)s: E s⁴ = 3d² + 6d, so the sample variance of N
    # independent pairs has relative standard error √((2 + 6/d) / N) ≈ 0.010; allow 5 of them.
    rel_se = math.sqrt((2 + 6 / d_k) / samples)
    for row in rows.values():
        assert abs(row["empirical_var"] / row["theory_var"] - 1) < 5 * rel_se


def test_example_3_softmax_values():
    rows = {row["scale"]: row for row in scale_study.softmax_example(64)}
    for name, factor in (("1", 1.0), ("1/√d_k", 1 / 8), ("1/d_k", 1 / 64)):
        (by_hand,) = softmax_rows([[0.0, 64 * factor, 128 * factor]])
        assert rows[name]["weights"] == pytest.approx(by_hand, rel=1e-12, abs=1e-300)
    # The values as commonly quoted, to the digits quoted.
    for name, quoted in (("1", [0.0, 0.0, 1.0]), ("1/√d_k", [1.12e-7, 3.35e-4, 0.99966]),
                         ("1/d_k", [0.090, 0.245, 0.665])):
        assert rows[name]["weights"] == pytest.approx(quoted, rel=0.01, abs=1e-12)


def test_experiment_statistics(experiment_rows):
    rows = {(row["d_k"], row["scale"]): row for row in experiment_rows}
    assert {d for d, _ in rows} == set(scale_study.D_KS)
    n_q = n_k = 64
    repeats = 3
    for d_k in scale_study.D_KS:
        plain, sqrt_scaled, over_d = rows[d_k, "1"], rows[d_k, "1/√d_k"], rows[d_k, "1/d_k"]
        # Relative variance of mean(s²) over the 64×64 grid: (2 + 6/d + 2(n_q + n_k - 2)/d) / n
        # (scores sharing a query or key are correlated through ‖q‖², ‖k‖²), over 3 draws.
        rel_se = math.sqrt((2 + 6 / d_k + 2 * (n_q + n_k - 2) / d_k) / (n_q * n_k * repeats))
        assert abs(plain["score_var"] / d_k - 1) < 5 * rel_se
        assert abs(sqrt_scaled["score_var"] - 1) < 5 * rel_se
        assert abs(over_d["score_var"] * d_k - 1) < 5 * rel_se
        # Larger scale, sharper softmax: entropy falls and the max weight rises.
        assert over_d["entropy"] > sqrt_scaled["entropy"] > plain["entropy"]
        assert over_d["max_weight"] < sqrt_scaled["max_weight"] < plain["max_weight"]
        for row in (plain, sqrt_scaled, over_d):
            assert 0 < row["entropy_frac"] <= 1 + 1e-12
            assert row["entropy"] == pytest.approx(row["entropy_frac"] * math.log(n_k))
            assert 1 / n_k - 1e-12 <= row["max_weight"] <= 1
            assert math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0
    # Saturation starves the scores of gradient: unscaled, ‖∂L/∂s‖ at d_k = 1024 is a fraction
    # of its value at d_k = 16 and far below the 1/√d_k run.
    assert rows[1024, "1"]["score_grad_norm"] < 0.5 * rows[16, "1"]["score_grad_norm"]
    assert rows[1024, "1"]["score_grad_norm"] < 0.5 * rows[1024, "1/√d_k"]["score_grad_norm"]


def test_experiment_gradient_matches_finite_difference():
    """grad_norm is ‖∂L/∂q_i‖ of L = Σ out ⊙ g: check one direction by central differences."""
    row = scale_study.experiment((16,), n_queries=4, n_keys=5, dim_v=3, repeats=1, seed=7)[1]
    generator = torch.Generator().manual_seed(7 * 1_000_003 + 16 * 101)
    q = torch.randn(4, 16, generator=generator, dtype=torch.float64)
    k = torch.randn(5, 16, generator=generator, dtype=torch.float64)
    v = torch.randn(5, 3, generator=generator, dtype=torch.float64)
    g = torch.randn(4, 3, generator=generator, dtype=torch.float64)

    def loss(q_):
        weights = torch.softmax(q_ @ k.T / 4.0, dim=-1)
        return ((weights @ v) * g).sum()

    eps, norms = 1e-6, []
    for i in range(4):
        grad_i = torch.zeros(16, dtype=torch.float64)
        for c in range(16):
            step = torch.zeros_like(q)
            step[i, c] = eps
            grad_i[c] = (loss(q + step) - loss(q - step)) / (2 * eps)
        norms.append(grad_i.norm().item())
    assert row["scale"] == "1/√d_k"
    assert row["grad_norm"] == pytest.approx(sum(norms) / 4, rel=1e-6)


def test_scale_study_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(scale_study, "D_KS", (16, 1024))  # the full sweep runs in the demo test
    assert cli.main(["scale-study", "--out", str(tmp_path), "--samples", "5000", "--seed", "2"]) == 0
    text = capsys.readouterr().out
    assert_png(tmp_path / "scale_study.png")
    assert "Variance of qᵀk" in text and "Softmax of s = [0, d_k, 2·d_k]" in text and "1024" in text
    assert "64.0000" in text  # theory Var(qᵀk) for d_k = 64


def test_scale_study_plot_has_one_legend_for_the_figure():
    """The four panels share one legend outside them, not one legend over each panel's lines."""
    rows = scale_study.experiment((16, 32), n_queries=4, n_keys=4, dim_v=2, repeats=1)
    figure = scale_study.study_figure(rows)
    assert len(figure.axes) == 4 and all(axes.get_legend() is None for axes in figure.axes)
    [legend] = figure.legends
    assert [text.get_text() for text in legend.get_texts()] == [f"scale {name}"
                                                                for name in scale_study.SCALES]


# ---- check -----------------------------------------------------------------------------------

class _Scaled(ReferenceBackend):
    """A wrong backend: the reference output times 1.01."""

    NAME = "broken"

    def forward(self, inputs):
        result = super().forward(inputs)
        return BackendOutput(result.out * 1.01, result.lse, result.weights)


class _Maskless(ReferenceBackend):
    """A wrong backend: ignores the mask."""

    NAME = "maskless"

    def forward(self, inputs):
        inputs.mask = None
        return super().forward(inputs)


class _NaN(ReferenceBackend):
    """A wrong backend: NaN on fully masked rows, correct elsewhere."""

    NAME = "nan"

    def forward(self, inputs):
        result = super().forward(inputs)
        empty = torch.isneginf(result.lse)[..., None]
        return BackendOutput(result.out.masked_fill(empty, float("nan")), result.lse, result.weights)


class _Refuses(ReferenceBackend):
    NAME = "picky"

    def extra_reasons(self, inputs):
        return ["every input (not supported by picky)"]


class _ForwardOnly(ReferenceBackend):
    NAME = "fwd-only"

    def extra_reasons(self, inputs):
        return ["backward (not supported by fwd-only)"] if inputs.need_grad else []


class _Absent(ReferenceBackend):
    NAME = "absent"

    def unavailable_reason(self):
        return "needs hardware this machine lacks"


def test_check_quick_passes_and_lists_reference_and_torch(capsys):
    assert cli.main(["check", "--quick"]) == 0
    text = capsys.readouterr().out
    assert "reference" in text and "torch" in text and "FAIL" not in text
    results = check_cmd.run_checks(quick=True, backends=["reference", "torch"])
    assert {r.backend for r in results} == {"reference", "torch"}
    assert all(r.status in ("PASS", "skip") for r in results)
    reference = [r for r in results if r.backend == "reference"]
    assert reference and all(r.status == "PASS" for r in reference)
    quantities = {m.quantity for r in reference for m in r.measures}
    assert quantities == {"out", "lse", "dq", "dk", "dv"}
    # One torch case has Dv != Dk, where torch returns no LSE: that quantity is skipped, with why.
    lse_skips = [m for r in results if r.backend == "torch" for m in r.measures
                 if m.quantity == "lse" and m.status == "skip"]
    assert lse_skips and all("not supported by torch" in m.reason for m in lse_skips)


@pytest.mark.parametrize("fake, bad_cases", [(_Scaled, "all"), (_Maskless, "masked"), (_NaN, "empty rows")])
def test_check_detects_a_broken_backend(monkeypatch, capsys, fake, bad_cases):
    monkeypatch.setitem(dispatch.BACKENDS, fake.NAME, fake())
    assert cli.main(["check", "--quick", "--backend", fake.NAME]) == 1
    assert "FAIL" in capsys.readouterr().out
    results = check_cmd.run_checks(quick=True, backends=[fake.NAME])
    failed = {r.case for r in results if r.status == "FAIL"}
    passed = {r.case for r in results if r.status == "PASS"}
    if bad_cases == "all":
        assert failed and not passed
    elif bad_cases == "masked":  # the maskless backend is right exactly where there is no mask
        assert passed == {c for c in passed | failed if c.startswith("none ")} and failed
    else:  # NaN only where a row is fully masked (padding, bottom-right causal with Tq > Tk)
        assert any("NaN" in r.reason for r in results if r.status == "FAIL")
        assert any(c.startswith("none ") for c in passed)
    assert fake.NAME not in dispatch.PRIORITY


def test_check_picks_up_new_backends_and_reports_skips(monkeypatch):
    registry = {"reference": dispatch.BACKENDS["reference"], "broken": _Scaled(),
                "picky": _Refuses(), "absent": _Absent(), "fwd-only": _ForwardOnly()}
    monkeypatch.setattr(dispatch, "BACKENDS", registry)
    results = check_cmd.run_checks(quick=True)  # no names: whatever is registered
    by_backend = {name: [r for r in results if r.backend == name] for name in registry}
    assert all(r.status == "PASS" for r in by_backend["reference"])
    assert by_backend["broken"] and all(r.status == "FAIL" for r in by_backend["broken"])
    assert by_backend["picky"] and all(r.status == "skip" and "not supported by picky" in r.reason
                                       for r in by_backend["picky"])
    assert [(r.status, r.reason) for r in by_backend["absent"]] == [("skip", "needs hardware this machine lacks")]
    # A forward-only backend is still checked forward; its gradients show as skipped, with why.
    forward_only = by_backend["fwd-only"]
    assert forward_only and all(r.status == "PASS" and r.measure("out").status == "PASS" for r in forward_only)
    grad_skips = [r.measure("dq") for r in forward_only if r.dtype == "float32"]
    assert grad_skips and all(m.status == "skip" and "fwd-only" in m.reason for m in grad_skips)


def test_check_unknown_backend_is_a_usage_error(capsys):
    assert cli.main(["check", "--quick", "--backend", "no-such-backend"]) == 2
    assert "no-such-backend" in capsys.readouterr().err


def test_plain_math_and_error_measure():
    """The yardstick: plain math in float64 matches the reference (fully masked rows included),
    and max_error treats equal infinities as exact and NaN as a failure."""
    for mask_name, shape in (("padding", check_cmd.RAGGED), ("causal(bottom_right)", check_cmd.TALL),
                             ("bias&causal", check_cmd.DV), ("dense", check_cmd.GQA)):
        truth = check_cmd._truth(mask_name, shape, torch.float64, seed=5)
        assert truth.plain_error["out"] < 1e-12 and truth.plain_error["lse"] < 1e-12
        assert torch.isneginf(truth.reference["lse"]).any() or mask_name in ("bias&causal",)
        low = check_cmd._truth(mask_name, shape, torch.float16, seed=5)
        assert 1e-5 < low.plain_error["out"] < 1e-1  # fp16 rounding, not a blunder
    ref = torch.tensor([1.0, float("-inf")], dtype=torch.float64)
    assert check_cmd.max_error(torch.tensor([1.5, float("-inf")]), ref) == 0.5
    assert math.isnan(check_cmd.max_error(torch.tensor([1.0, float("nan")]), ref))
    assert check_cmd.max_error(torch.tensor([1.0, 0.0]), ref) == math.inf


# ---- info, demo, help, registry --------------------------------------------------------------

def test_info_lists_backends_and_dispatch(capsys):
    assert cli.main(["info"]) == 0
    text = capsys.readouterr().out
    for name, backend in dispatch.BACKENDS.items():
        assert name in text
        status = "available" if backend.is_available() else backend.unavailable_reason()
        assert all(word in text for word in status.split())  # the table may fold long reasons
    assert torch.__version__ in text and np.__version__ in text
    assert "triton" in text and "cuda" in text
    assert " → ".join(dispatch.PRIORITY) in text
    assert dispatch.AUTO_RULES[0] in text


def test_demo_writes_both_pngs(tmp_path, capsys):
    assert cli.main(["demo", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert_png(tmp_path / "explain_weights.png")
    assert_png(tmp_path / "scale_study.png")
    assert "0.8816" in text and "passed" in text and str(tmp_path) in text
    assert not INTERNAL.search(text), INTERNAL.search(text)


def test_demo_fails_when_check_fails(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(check_cmd, "QUICK_CASES", check_cmd.QUICK_CASES[:1])
    monkeypatch.setattr(check_cmd, "QUICK_DTYPES", (torch.float32,))
    monkeypatch.setattr(scale_study, "D_KS", (16, 32))
    monkeypatch.setattr(scale_study, "plot_study", lambda rows, path: path)  # PNGs: tested above
    monkeypatch.setattr(dispatch, "BACKENDS", {"reference": dispatch.BACKENDS["reference"],
                                               "broken": _Scaled()})
    assert cli.main(["demo", "--out", str(tmp_path)]) == 1
    assert "failed: check" in capsys.readouterr().out


@pytest.mark.parametrize("command", [None, *cli.COMMANDS])
def test_help_exits_zero(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"] if command is None else [command, "--help"])
    assert exit_info.value.code == 0
    assert "usage: attnkit" in capsys.readouterr().out


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 0
    assert "scale-study" in capsys.readouterr().out


def test_a_new_command_plugs_into_the_table(monkeypatch, capsys):
    module = types.ModuleType("fake_bench_command")
    module.HELP = "a stand-in for attnkit bench"
    module.add_arguments = lambda parser: parser.add_argument("--repeat", type=int, default=1)
    module.run = lambda args, console: console.print(f"bench x{args.repeat}") or 7
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(cli.COMMANDS, "bench", module.__name__)
    assert cli.main(["bench", "--repeat", "3"]) == 7
    assert "bench x3" in capsys.readouterr().out


@pytest.mark.parametrize("module", ["attnkit.cli", "attnkit"])
def test_module_entry_point_runs(module):
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for name in cli.COMMANDS:
        assert name in done.stdout


# ---- user errors: one line on stderr, exit 2, before any work ---------------------------------

def assert_one_line_error(capsys, command, *words):
    """The captured stderr is exactly one ``attnkit COMMAND: error: ...`` line naming ``words``;
    stdout holds no error and no traceback appears anywhere."""
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"attnkit {command}: error: "), lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert "Traceback" not in captured.err + captured.out and "error" not in captured.out
    return lines[0]


def _refuse_to_work(monkeypatch):
    """Make every command's main work fail loudly, so a test sees whether it started."""
    from attnkit.bench import runner

    def started(*args, **kwargs):
        raise AssertionError("the work started before the output path was checked")
    monkeypatch.setattr(explain_cmd, "steps", started)
    monkeypatch.setattr(scale_study, "scale_study", started)
    monkeypatch.setattr(check_cmd, "run_checks", started)
    monkeypatch.setattr(runner, "run_benchmark", started)


@pytest.mark.parametrize("command, option, where", [
    ("explain", "--plot", "file/x.png"),            # the parent folder is a regular file
    ("explain", "--plot", "file/sub/x.png"),        # an ancestor is a regular file
    ("explain", "--plot", "folder"),                # the output file is an existing folder
    ("explain", "--plot", "/proc/nope/x.png"),      # a folder that cannot be created
    ("scale-study", "--out", "file"),               # --out is a folder, given an existing file
    ("scale-study", "--out", "/proc/nope"),
    ("scale-study", "--out", "blocked"),            # blocked/scale_study.png is a folder
    ("demo", "--out", "file"),
    ("demo", "--out", "file/sub"),
    ("bench", "--out", "file"),
    ("bench", "--out", "/proc/nope/results"),
])
def test_unusable_output_path_fails_before_the_work(tmp_path, monkeypatch, capsys, command,
                                                    option, where):
    if where.startswith("/proc") and not __import__("os").path.isdir("/proc"):
        pytest.skip("needs /proc, a folder where no folder can be created")
    (tmp_path / "file").write_text("not a folder")
    (tmp_path / "folder").mkdir()
    (tmp_path / "blocked" / "scale_study.png").mkdir(parents=True)
    _refuse_to_work(monkeypatch)
    path = where if where.startswith("/") else str(tmp_path / where)
    argv = [command, option, path] + (["--quick"] if command == "bench" else [])
    assert cli.main(argv) == 2
    assert_one_line_error(capsys, command, f"{option} {path}")
    assert (tmp_path / "file").read_text() == "not a folder"


def test_check_output_creates_folders_and_leaves_nothing_behind(tmp_path):
    from attnkit.cli._common import UsageError, check_output

    target = tmp_path / "a" / "b" / "plot.png"
    assert check_output("--plot", str(target)) == target
    assert target.parent.is_dir() and list(target.parent.iterdir()) == []  # no scratch file left
    folder = tmp_path / "out"
    assert check_output("--out", str(folder), "x.json", "y.png") == folder
    assert folder.is_dir() and list(folder.iterdir()) == []
    (folder / "x.json").write_text("{}")  # an existing writable output file is fine
    check_output("--out", str(folder), "x.json")
    (folder / "y.png").mkdir()
    with pytest.raises(UsageError, match=r"^--out .*y\.png is a folder"):
        check_output("--out", str(folder), "x.json", "y.png")
    with pytest.raises(UsageError, match=r"^--out .*is a file, not a folder"):
        check_output("--out", str(folder / "x.json"), "z.png")


@pytest.mark.parametrize("argv, words", [
    (["bench", "--quick", "--reps", "0"], ["--reps 0", "at least 1"]),
    (["bench", "--quick", "--threads", "-2"], ["--threads -2", "at least 1"]),
    (["bench", "--quick", "--workloads", "nope"], ["--workloads", "nope", "choose from"]),
    (["bench", "--quick", "--methods", "sdpa"], ["--methods", "tiled"]),
    (["bench", "--quick", "--methods", "tiled", "bogus"], ["--methods", "bogus", "choose from"]),
    (["scale-study", "--samples", "1"], ["--samples 1", "at least 2"]),
    (["check", "--backend", "no-such-backend"], ["--backend", "no-such-backend", "choose from"]),
    (["explain", "--q", "[[1, 0], [2"], ["--q", "JSON"]),
    (["explain", "--q", "missing.npy"], ["--q", "missing.npy", "no such file"]),
])
def test_user_errors_are_one_line_on_stderr(tmp_path, monkeypatch, capsys, argv, words):
    monkeypatch.chdir(tmp_path)
    _refuse_to_work(monkeypatch)
    assert cli.main(argv) == 2
    assert_one_line_error(capsys, argv[0], *words)


@pytest.mark.parametrize("command", ["check", "scale-study"])
@pytest.mark.parametrize("seed", ["-1", str(2 ** 70)])
def test_out_of_range_seed_is_a_usage_error(monkeypatch, capsys, command, seed):
    _refuse_to_work(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--seed", seed])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--seed" in err and "from 0 to" in err and "Traceback" not in err


def test_check_of_an_unavailable_backend_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setitem(dispatch.BACKENDS, "absent", _Absent())
    _refuse_to_work(monkeypatch)
    assert cli.main(["check", "--quick", "--backend", "reference", "absent"]) == 2
    assert_one_line_error(capsys, "check", "--backend absent", "needs hardware this machine lacks",
                          "reference")


def test_check_of_triton_without_a_gpu_is_a_usage_error(capsys):
    import attnkit

    reason = attnkit.available_backends().get("triton")
    if not reason:
        pytest.skip("triton can run here")
    assert cli.main(["check", "--quick", "--backend", "triton"]) == 2
    assert_one_line_error(capsys, "check", "--backend triton", reason.split(",")[0])


@pytest.mark.parametrize("registry", [{"picky": _Refuses()}, {"absent": _Absent()}])
def test_check_that_checked_nothing_fails(monkeypatch, capsys, registry):
    monkeypatch.setattr(dispatch, "BACKENDS", registry)
    monkeypatch.setattr(check_cmd, "QUICK_CASES", check_cmd.QUICK_CASES[:2])
    assert cli.main(["check", "--quick"]) == 1
    captured = capsys.readouterr()
    assert "0 passed, 0 failed" in captured.out
    assert "nothing was checked" in captured.err and len(captured.err.strip().splitlines()) == 1


@pytest.mark.parametrize("make, words", [
    (lambda: np.array([[1 + 2j, 0], [2, 1j]]), ["complex128", "imaginary", "real"]),
    (lambda: np.array([[1, 0], [2, 0]], dtype=np.complex64), ["complex64", "real"]),
    (lambda: np.array([[True, False], [False, True]]), ["bool", "astype(float)"]),
    (lambda: np.array([["1", "0"], ["2", "0"]]), ["<U1", "astype(float)"]),
    (lambda: np.array([["2020-01-01"]], dtype="datetime64[D]"), ["datetime64[D]", "astype(float)"]),
    (lambda: np.zeros((0, 2)), ["empty", "(0, 2)"]),
])
def test_explain_refuses_npy_arrays_that_are_not_real_numbers(tmp_path, monkeypatch, capsys, make,
                                                               words):
    _refuse_to_work(monkeypatch)
    path = tmp_path / "q.npy"
    np.save(path, make())
    assert cli.main(["explain", "--q", str(path)]) == 2
    assert_one_line_error(capsys, "explain", "--q", str(path), *words)


def test_explain_refuses_object_npz_and_json_non_numbers(tmp_path, monkeypatch, capsys):
    _refuse_to_work(monkeypatch)
    objects = tmp_path / "objects.npy"
    np.save(objects, np.array([[1, None]], dtype=object), allow_pickle=True)
    archive = tmp_path / "archive.npy"
    with open(archive, "wb") as handle:
        np.savez(handle, q=np.zeros((2, 2)))
    for argv, words in ((["--q", str(objects)], ["--q", "Object arrays"]),
                        (["--k", str(archive)], ["--k", ".npz archive"]),
                        (["--q", "[[true, false]]"], ["--q", "bool"]),
                        (["--q", "[[true, 1]]"], ["--q", "true/false", "1 and 0"]),
                        (["--v", '[["1", "0"]]'], ["--v", "strings"]),
                        (["--q", "[[1, null]]"], ["--q", "object"])):
        assert cli.main(["explain", *argv]) == 2
        assert_one_line_error(capsys, "explain", *words)


def test_check_invariance_prints_the_contract_table(capsys, monkeypatch):
    assert cli.main(["check", "--invariance", "--backend", "tiled", "torch"]) == 0
    text = capsys.readouterr().out
    assert "holds" in text and "refused" in text and "BROKEN" not in text
    # a tiled engine that merges in another order on every call is named BROKEN, exit 1
    from attnkit.backends.tiled import forward, plan
    from attnkit.masks import MaskCache
    calls = iter(range(10**6))
    monkeypatch.setattr(forward, "_in_key_order", lambda visits: sorted(visits.items())[
        ::1 if next(calls) % 2 else -1])
    monkeypatch.setattr(plan, "_PLANS", MaskCache(64))
    assert cli.main(["check", "--invariance", "--backend", "tiled"]) == 1
    assert "BROKEN" in capsys.readouterr().out


def test_check_invariance_that_checks_nothing_fails(capsys):
    """torch refuses every point of the contract: nothing held, exit 1 (a CI job must not pass
    on an empty table)."""
    assert cli.main(["check", "--invariance", "--quick", "--backend", "torch"]) == 1
    assert "nothing could be checked" in capsys.readouterr().out


def test_check_invariance_on_a_numbered_cpu_runs_the_ring_too(capsys):
    assert cli.main(["check", "--invariance", "--quick", "--backend", "tiled", "--device",
                     "cpu:0"]) == 0
    assert "ring" in capsys.readouterr().out


def test_device_goes_with_invariance(capsys):
    assert cli.main(["check", "--device", "cpu"]) == 2
    assert "--invariance" in capsys.readouterr().err


@pytest.mark.parametrize("device, words", [("nope", "not a device name"),
                                           ("meta:x", "not a device name"),
                                           ("meta", "meta tensors hold no values"),
                                           ("hpu", "not a device this machine has")]
                         + ([] if torch.cuda.is_available() else
                            [("cuda", "not a device this machine has")]))
def test_a_device_this_machine_lacks_is_a_usage_error(device, words, capsys):
    assert cli.main(["check", "--invariance", "--quick", "--device", device]) == 2
    err = capsys.readouterr().err
    assert f"--device {device}: {words}" in err and "Traceback" not in err


@pytest.mark.parametrize("option, text, value, index", [
    ("--q", "[[1.5, true], [2, 0]]", "true", "[0][1]"),   # next to floats numpy reads 1.0
    ("--k", "[[1, 0], [2, false]]", "false", "[1][1]"),   # next to integers
    ("--v", "[[[0.5, 1]], [[true, 2.5]]]", "true", "[1][0][0]"),
    ("--q", "true", "true", "top level"),
])
def test_explain_refuses_json_booleans_naming_the_element(monkeypatch, capsys, option, text,
                                                          value, index):
    """Q, K and V are numbers: a JSON true/false is refused wherever it stands, never read as 1."""
    _refuse_to_work(monkeypatch)
    assert cli.main(["explain", option, text]) == 2
    assert_one_line_error(capsys, "explain", option, f"boolean {value} at", index,
                          "where a number is needed", "1 and 0")


@pytest.mark.parametrize("out", ["", " "])
def test_bench_refuses_an_empty_out_folder(tmp_path, monkeypatch, capsys, out):
    """An empty --out is a mistake, not a request for the default folder."""
    monkeypatch.chdir(tmp_path)
    _refuse_to_work(monkeypatch)
    assert cli.main(["bench", "--quick", "--out", out]) == 2
    assert_one_line_error(capsys, "bench", "--out", "empty", "folder path")
    assert not any(tmp_path.iterdir())


def test_bench_refuses_flex_left_out_of_its_methods(tmp_path, monkeypatch, capsys):
    """--flex asks for FlexAttention; --methods without flex would drop it silently."""
    monkeypatch.chdir(tmp_path)
    _refuse_to_work(monkeypatch)
    assert cli.main(["bench", "--quick", "--flex", "--methods", "tiled", "sdpa"]) == 2
    assert_one_line_error(capsys, "bench", "--flex", "--methods tiled sdpa", "add flex")

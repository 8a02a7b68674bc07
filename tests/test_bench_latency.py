"""CPU smoke tests of ``backplane bench latency`` and ``benchmarks/profile_decode.py``.

They run the tiny presets for a few tokens and check structure and sanity:
positive finite figures, the same token count on both sides, the memory floor
below every measured time, the same first tokens from the same weights. Never
a timing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from backplane.cli import main
from backplane.cli.bench import latency as bench_latency

SHAPES = ("tiny-llama", "tiny-nemotron-h")
BATCHES = (1, 2)
NEW_TOKENS = 3
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
PROFILE_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "profile_decode.py"


def _finite_positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One benchmark run over both tiny presets; its JSON and its printed report."""
    out = tmp_path_factory.mktemp("latency") / "latency.json"
    argv = [
        "bench",
        "latency",
        "--device",
        "cpu",
        "--shapes",
        ",".join(SHAPES),
        "--batch-sizes",
        ",".join(map(str, BATCHES)),
        "--prompt-len",
        "8",
        "--new-tokens",
        str(NEW_TOKENS),
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--attention",
        "torch,triton",
        "--transformers",
        "eager,compile" if HAS_TRANSFORMERS else "none",
        "--json",
        str(out),
    ]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = main(argv)
    assert rc == 0
    return {"json": json.loads(out.read_text()), "path": out, "report": stdout.getvalue()}


def _config(shape: dict[str, Any], label: str) -> dict[str, Any]:
    by_label = {c["label"]: c for c in shape["configs"]}
    assert label in by_label, f"{label!r} not in {sorted(by_label)}"
    return by_label[label]


def test_result_describes_machine_and_every_shape(run):
    res = run["json"]
    assert res["machine"]["device"] == "cpu" and res["machine"]["torch"]
    assert _finite_positive(res["bandwidth"]["bytes_per_s"])
    assert res["settings"]["batch_sizes"] == list(BATCHES)
    assert [s["name"] for s in res["shapes"]] == list(SHAPES)
    for shape in res["shapes"]:
        assert shape["params"] > 0 and shape["weight_bytes"] > 0
        assert shape["kv_bytes_per_token"] > 0
        assert shape["configs"][0]["kind"] == "floor"
    hybrid = res["shapes"][1]
    assert hybrid["state_bytes_per_seq"] > 0  # Mamba layers carry state
    assert res["shapes"][0]["state_bytes_per_seq"] == 0


def test_backplane_and_transformers_rows_are_sane(run):
    for shape in run["json"]["shapes"]:
        floor = {r["batch"]: r["ms_per_token"] for r in _config(shape, "memory floor")["batches"]}
        assert sorted(floor) == list(BATCHES)
        assert all(_finite_positive(v) for v in floor.values())
        measured = ["backplane torch, eager"]
        if HAS_TRANSFORMERS:
            measured.append("transformers eager")
        for label in measured:
            entry = _config(shape, label)
            assert entry["status"] == "ok", entry.get("reason")
            assert [r["batch"] for r in entry["batches"]] == list(BATCHES)
            for row in entry["batches"]:
                assert row["status"] == "ok", row.get("reason")
                assert _finite_positive(row["ms_per_token"])
                assert _finite_positive(row["ttft_ms"])
                assert row["tokens_per_request"] == [NEW_TOKENS] * row["batch"]
                assert floor[row["batch"]] < row["ms_per_token"]
        if HAS_TRANSFORMERS:
            # the same saved weights on both sides: greedy decoding starts alike
            for row in _config(shape, "backplane torch, eager")["batches"]:
                agreement = row["agreement"]
                assert agreement["reference"] == "transformers eager"
                assert agreement["first_token_equal"] == agreement["requests"] == row["batch"]


def test_unavailable_configurations_are_skipped_with_a_reason(run):
    import torch

    for shape in run["json"]["shapes"]:
        graphs = _config(shape, "backplane torch, graphs")
        assert graphs["status"] == "skipped" and "CUDA" in graphs["reason"]
        # the Triton interpreter makes the Triton backend available without CUDA
        if not torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET"):
            triton = _config(shape, "backplane triton, eager")
            assert triton["status"] == "skipped" and "triton" in triton["reason"]
        if HAS_TRANSFORMERS:
            compiled = _config(shape, "transformers static+compile")
            assert compiled["status"] == "skipped" and "--compile-on-cpu" in compiled["reason"]


def test_report_has_a_table_per_shape(run):
    report = run["report"]
    for name in SHAPES:
        assert f"{name}: " in report
    assert report.count("b=1 ms") == len(SHAPES)
    assert "backplane torch, eager" in report and "memory floor" in report
    assert "not measured:" in report


def test_plot_from_saved_json(run, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "latency.png"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(["bench", "latency", "--plot-from", str(run["path"]), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert stdout.getvalue() == run["report"]


def test_plot_from_merges_several_results(run, tmp_path):
    pytest.importorskip("matplotlib")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        argv = ["bench", "latency", "--plot-from", str(run["path"]), str(run["path"])]
        assert main([*argv, "--plot", str(tmp_path / "two.png")]) == 0
    assert stdout.getvalue().count("b=1 ms") == 2 * len(SHAPES)
    assert (tmp_path / "two.png").is_file()


def test_plot_without_matplotlib_says_how_to_install(run, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(bench_latency.BackplaneError, match="pip install matplotlib"):
        bench_latency.write_plot(run["json"], tmp_path / "x.png")


def test_plot_from_rejects_other_json(tmp_path, capsys):
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"rows": []}))
    assert main(["bench", "latency", "--plot-from", str(bad)]) == 2
    assert "is not a result of `backplane bench latency --json`" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--shapes", "llama-1bb"], "did you mean 'llama-1b'"),
        (["--new-tokens", "1"], "at least 2"),
        (["--cuda-graphs", "maybe"], "use on, off"),
        (["--shapes", "tiny-llama", "--prompt-len", "4000"], "positions"),
        (["--custom-all-reduce"], "--tensor-parallel-size 2 or more"),
    ],
)
def test_bad_settings_are_user_errors(flags, message, capsys):
    assert main(["bench", "latency", "--device", "cpu", *flags]) == 2
    assert message in capsys.readouterr().err


def test_floor_counts_embedding_rows_experts_and_state():
    info = bench_latency.WeightsInfo(
        folder="",
        params=0,
        weight_bytes=10_000,
        embedding_bytes=1_000,
        embedding_row_bytes=10,
        lm_head_bytes=1_000,
        tied=False,
        expert_bytes=4_000,
        num_experts=8,
        experts_per_token=2,
        kv_bytes_per_token=4.0,
        state_bytes_per_seq=100,
    )
    one = bench_latency.floor_bytes(info, 1, prompt_len=10, new_tokens=4)
    # other weights 4000 + LM head 1000 + one embedding row + 2 of 8 experts
    assert one["weights"] == 4_000 + 1_000 + 10 + 1_000
    assert one["mean_context"] == 12
    assert one["kv_cache"] == 4 * 13
    assert one["recurrent_state"] == 200
    assert one["total"] == one["weights"] + one["kv_cache"] + one["recurrent_state"]
    many = bench_latency.floor_bytes(info, 8, prompt_len=10, new_tokens=4)
    assert many["weights"] == 4_000 + 1_000 + 80 + 4_000  # every expert is used


def test_latency_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "latency", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--shapes", "--batch-sizes", "--json", "--plot", "--plot-from"):
        assert flag in out


# -- benchmarks/profile_decode.py --------------------------------------------------------


@pytest.fixture(scope="module")
def profile_decode() -> Any:
    spec = importlib.util.spec_from_file_location("profile_decode", PROFILE_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_profile_script_shapes_match_the_benchmark(profile_decode):
    assert profile_decode.SHAPES == bench_latency.SHAPES


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("nvjet_tst_128x64_64x8_2x1_v_bz_coopA_TNT", "gemm"),
        ("_decode_kernel", "attention"),
        ("BatchDecodeWithPagedKVCacheKernel", "attention"),
        ("_selective_scan_update_kernel", "ssm"),
        ("_chunk_cumsum_fwd_kernel", "ssm"),
        (
            "reduce_kernel<512, 1, ReduceOp<float, ArgMaxOps<float>, unsigned int, long, 4>>",
            "sampling",
        ),
        ("void flashinfer::norm::RMSNormKernel<8u, __nv_bfloat16>", "elementwise/norm/rope"),
        ("triton_poi_fused_add_mul_0", "elementwise/norm/rope"),
        ("Memcpy HtoD (Pageable -> Device)", "copies"),
        ("indexSelectSmallIndex<c10::BFloat16, long, unsigned int, 2, 2, -2>", "copies"),
        ("some_unknown_kernel", "other"),
    ],
)
def test_kernel_names_are_classified(profile_decode, name, kind):
    assert profile_decode.classify(name) == kind


def test_cpu_op_called_from_a_backend_is_attributed_to_it(profile_decode):
    stack = ["/x/backplane/backends/torch/ssm.py(40): scan", "/x/backplane/models/x.py(3): f"]
    assert profile_decode.classify("aten::einsum", stack) == "ssm"
    model_only = ["/x/backplane/models/mixers/attention.py(9): forward"]
    assert profile_decode.classify("aten::linear", model_only) == "gemm"


def test_profile_decode_on_cpu(profile_decode, tmp_path, capsys):
    out = tmp_path / "profile.json"
    argv = ["--shape", "tiny-llama", "--device", "cpu", "--prompt-len", "8"]
    argv += ["--steps", "2", "--warmup", "1", "--batch-size", "2", "--json", str(out)]
    assert profile_decode.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["settings"]["batch_size"] == 2 and res["settings"]["steps"] == 2
    assert _finite_positive(res["wall_us_per_step"])
    assert _finite_positive(res["kernels_per_step"])
    assert _finite_positive(res["device_us_per_step"])
    assert res["host_us_per_step"] >= 0
    by_kind = res["by_kind"]
    assert list(by_kind) == list(profile_decode.KINDS)
    total = sum(v["us_per_step"] for v in by_kind.values())
    assert total == pytest.approx(res["device_us_per_step"])
    assert by_kind["gemm"]["us_per_step"] > 0
    assert res["top_kernels"] and all(k["kind"] in profile_decode.KINDS for k in res["top_kernels"])
    report = capsys.readouterr().out
    assert "us/step" in report and "gemm" in report


def test_saved_random_weights_are_reused_and_sized_alike(tmp_path):
    import torch

    from backplane.cli.bench.latency.shapes import shape_config
    from backplane.cli.bench.latency.weights import save_random_weights

    first = save_random_weights("tiny-llama", shape_config("tiny-llama"), tmp_path, torch.float32)
    stamp = (tmp_path / "model.safetensors").stat().st_mtime_ns
    again = save_random_weights("tiny-llama", shape_config("tiny-llama"), tmp_path, torch.float32)
    assert (tmp_path / "model.safetensors").stat().st_mtime_ns == stamp
    assert again == first
    # another dtype is another set of weights: saved anew
    save_random_weights("tiny-llama", shape_config("tiny-llama"), tmp_path, torch.float16)
    assert (tmp_path / "model.safetensors").stat().st_mtime_ns != stamp

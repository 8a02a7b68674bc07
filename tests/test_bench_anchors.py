"""Published figures beside ``bench latency`` / ``bench throughput`` results, and the floor of a tied vocabulary.

The anchors are looked up by shape, workload and GPU kind and printed only
where all three match; ratios are checked against the figures computed here.
The memory floor of a model whose LM head is its embedding is checked against
byte counts computed from the config alone, for the saved random weights and
for a model directory given as a shape.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from typing import Any

import pytest
import torch

from backplane.cli import main
from backplane.cli.bench import anchors
from backplane.cli.bench.latency.floor import floor_bytes
from backplane.cli.bench.latency.report import format_report
from backplane.cli.bench.latency.shapes import SHAPES, shape_config
from backplane.cli.bench.latency.weights import folder_weights_info, save_random_weights
from backplane.cli.bench.throughput.report import print_report

MEGAKERNELS_URL = (
    "https://github.com/msaroufim/megakernels-vs-cuda-graphs/blob/main/llama/docs/RESULTS.md"
)
AIMULTIPLE_URL = "https://research.aimultiple.com/inference-engines"


# -- lookup ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA H200 141GB HBM3e", "H200"),
        ("NVIDIA H100 PCIe", None),
        ("NVIDIA H100 NVL", None),
        ("NVIDIA GH200 480GB", None),
        ("NVIDIA A100-SXM4-80GB", None),
        (None, None),
    ],
)
def test_gpu_kind_from_the_device_name(name, kind):
    assert anchors.gpu_kind(name) == kind


def test_every_anchor_names_a_known_shape_and_a_source():
    for a in anchors.ANCHORS:
        assert a.shape in SHAPES
        assert a.workload in (anchors.DECODE_BATCH1, anchors.SHAREGPT_OFFLINE)
        assert a.gpu in ("H100", "H200")
        assert a.figure > 0
        assert a.source and a.url.startswith("https://")


def test_lookup_by_shape_workload_and_gpu():
    h200 = anchors.find_anchors("llama-3.2-1b", anchors.DECODE_BATCH1, "H200")
    assert sorted((a.system, a.figure) for a in h200) == [
        ("CUDA graphs + PDL + fused projections", 0.79474),
        ("HazyResearch megakernel", 0.75983),
    ]
    assert {a.url for a in h200} == {MEGAKERNELS_URL}
    h100 = anchors.find_anchors("llama-3.1-8b", anchors.SHAREGPT_OFFLINE, "H100")
    assert {a.system.split()[0]: a.figure for a in h100} == {
        "SGLang": 16215.0,
        "LMDeploy": 16132.0,
        "vLLM": 12553.0,
    }
    assert all(a.unit == "output tok/s" and not a.lower_is_better for a in h100)
    assert anchors.find_anchors("llama-3.1-8b", anchors.SHAREGPT_OFFLINE, "H200") == []
    assert anchors.find_anchors("llama-3.1-8b", anchors.DECODE_BATCH1, "H100") == []
    assert anchors.find_anchors("llama-1b", anchors.DECODE_BATCH1, "H200") == []
    assert anchors.find_anchors("llama-3.2-1b", anchors.DECODE_BATCH1, None) == []


# -- bench latency report ----------------------------------------------------------------


def _latency_result(gpu: str | None, *, shape: str = "llama-3.2-1b", dtype: str = "bfloat16"):
    """A result as ``run_benchmark`` returns it, with two backplane configurations."""

    def rows(b1: float, b8: float) -> list[dict[str, Any]]:
        return [
            {"batch": 1, "status": "ok", "ms_per_token": b1, "ttft_ms": 5.0},
            {"batch": 8, "status": "ok", "ms_per_token": b8, "ttft_ms": 9.0},
        ]

    return {
        "machine": {"gpu": gpu, "cpu": "cpu", "cores": 2, "torch": "2", "triton": None},
        "settings": {},
        "bandwidth": {"bytes_per_s": 4.0e12, "method": "test"},
        "shapes": [
            {
                "name": shape,
                "architecture": "LlamaForCausalLM",
                "params": 1_235_814_400,
                "weight_bytes": 2_471_628_800,
                "run": {
                    "batch_sizes": [1, 8],
                    "prompt_len": 32,
                    "new_tokens": 128,
                    "dtype": dtype,
                    "repeats": 3,
                },
                "configs": [
                    {
                        "label": "HBM floor",
                        "kind": "floor",
                        "status": "ok",
                        "batches": rows(0.6, 0.7),
                    },
                    {
                        "label": "backplane torch, graphs",
                        "kind": "backplane",
                        "status": "ok",
                        "batches": rows(1.30, 1.5),
                    },
                    {
                        "label": "backplane triton, graphs",
                        "kind": "backplane",
                        "status": "ok",
                        # the slower one at batch 8: batch 1 alone picks the best
                        "batches": rows(0.90, 2.0),
                    },
                ],
            }
        ],
    }


def test_latency_report_prints_the_anchors_of_a_matching_gpu():
    report = format_report(_latency_result("NVIDIA H200"))
    lines = [line for line in report.splitlines() if line.strip().startswith("published")]
    assert len(lines) == 2
    for line, figure in zip(lines, (0.79474, 0.75983), strict=True):
        assert f"{0.90 / figure:.2f}x" in line
        assert "backplane triton, graphs, batch 1" in line
        assert MEGAKERNELS_URL in line
        assert "lower is better" in line
    assert "against published figures:" in report


@pytest.mark.parametrize(
    ("gpu", "shape", "dtype"),
    [
        ("NVIDIA A100-SXM4-80GB", "llama-3.2-1b", "bfloat16"),
        (None, "llama-3.2-1b", "bfloat16"),
        ("NVIDIA H200", "llama-1b", "bfloat16"),
        ("NVIDIA H200", "llama-3.2-1b", "float16"),
    ],
)
def test_latency_report_prints_no_anchor_elsewhere(gpu, shape, dtype):
    report = format_report(_latency_result(gpu, shape=shape, dtype=dtype))
    assert "published" not in report
    assert "megakernels" not in report


def test_latency_anchor_figures_for_the_h100():
    rows = anchors.latency_comparisons(
        _latency_result("NVIDIA H100 80GB HBM3")["shapes"][0], "NVIDIA H100 80GB HBM3"
    )
    assert [(r["figure"], round(r["ratio"], 6)) for r in rows] == [
        (0.97951, round(0.90 / 0.97951, 6)),
        (0.97278, round(0.90 / 0.97278, 6)),
    ]


# -- bench throughput report -------------------------------------------------------------


def _throughput_result(gpu: str) -> dict[str, Any]:
    """A result as ``run_throughput`` returns it, at rates 16 and inf."""

    def row(rate: Any, tok_s: float) -> dict[str, Any]:
        return {
            "rate": rate,
            "completed": 1000,
            "failed": 0,
            "request_throughput": 40.0,
            "output_token_throughput": tok_s,
            "total_token_throughput": 2 * tok_s,
            "ttft_ms_p50": 1.0,
            "ttft_ms_p99": 2.0,
            "itl_ms_p50": 1.0,
            "itl_ms_p99": 2.0,
            "e2e_ms_p50": 10.0,
            "e2e_ms_p99": 20.0,
            "errors": [],
            "exact_lengths": True,
        }

    lengths = {"mean": 200.0, "min": 4, "max": 1024}
    result = {
        "machine": {"gpu": gpu, "cpu": "cpu", "cores": 16, "torch": "2"},
        "model": {"name": "llama-3.1-8b", "architecture": "LlamaForCausalLM"},
        "engine": {
            "config": {
                "dtype": "bfloat16",
                "device": "cuda",
                "cuda_graphs": "full_and_piecewise",
                "max_num_seqs": 256,
                "max_num_tokens": 8192,
            },
            "backends": {"attention": "triton"},
            "max_model_len": 8192,
        },
        "workload": {
            "num_prompts": 1000,
            "mix": "sharegpt-like",
            "seed": 0,
            "prompt_tokens": lengths,
            "output_tokens": lengths,
        },
        "rates": [row(16.0, 3000.0), row("inf", 14000.0)],
        "transformers": {"status": "skipped", "reason": "--no-transformers"},
        "decode": {"batches": [], "prompt_len": 32, "steps": 128, "floor_skipped": None},
    }
    return result


def _printed(result: dict[str, Any]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_report(result)
    return out.getvalue()


def test_throughput_report_prints_the_anchors_on_an_h100():
    text = _printed(_throughput_result("NVIDIA H100 80GB HBM3"))
    lines = [line for line in text.splitlines() if line.strip().startswith("published")]
    assert len(lines) == 3
    for figure in (16215.0, 16132.0, 12553.0):
        (line,) = [ln for ln in lines if f"{figure:,.0f} output tok/s" in ln]
        assert f"= {14000.0 / figure:.2f}x" in line
        assert AIMULTIPLE_URL in line
        assert "1000 requests at rate inf" in line
        assert "higher is better" in line


def _set(section: str, field: str, value: Any) -> Any:
    def change(result: dict[str, Any]) -> None:
        result[section][field] = value

    return change


def _set_dtype(result: dict[str, Any]) -> None:
    result["engine"]["config"]["dtype"] = "float16"


def _set_tp2(result: dict[str, Any]) -> None:
    result["engine"]["config"]["tensor_parallel_size"] = 2


@pytest.mark.parametrize(
    ("gpu", "change"),
    [
        ("NVIDIA H200", None),
        ("NVIDIA A100-SXM4-80GB", None),
        ("NVIDIA H100 80GB HBM3", _set("workload", "num_prompts", 200)),
        ("NVIDIA H100 80GB HBM3", _set("workload", "mix", "fixed")),
        ("NVIDIA H100 80GB HBM3", _set("model", "name", "llama-1b")),
        ("NVIDIA H100 80GB HBM3", _set_dtype),
        ("NVIDIA H100 80GB HBM3", _set_tp2),
    ],
)
def test_throughput_report_prints_no_anchor_elsewhere(gpu, change):
    result = _throughput_result(gpu)
    if change is not None:
        change(result)
    assert anchors.throughput_comparisons(result) == []
    assert "published" not in _printed(result)


def test_throughput_anchor_needs_the_inf_rate():
    result = _throughput_result("NVIDIA H100 80GB HBM3")
    result["rates"] = result["rates"][:1]
    assert anchors.throughput_comparisons(result) == []


# -- the memory floor of a tied vocabulary -------------------------------------------------


def _tiny_llama(tied: bool) -> dict[str, Any]:
    """A tiny Llama whose vocabulary is large against its body, like Llama-3.2-1B's."""
    config = shape_config("tiny-llama")
    config.update(vocab_size=4096, tie_word_embeddings=tied)
    return config


def _expected_bytes(config: dict[str, Any], batch: int, element: int) -> dict[str, int]:
    """What one decode step reads, from the config alone.

    Every weight once, except the input embedding (only ``batch`` rows); when
    tied, the LM head is the embedding and is read in full.
    """
    v, h, i = config["vocab_size"], config["hidden_size"], config["intermediate_size"]
    layers, heads, kv_heads = (
        config["num_hidden_layers"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    )
    d = config["head_dim"]
    per_layer = h * heads * d + 2 * h * kv_heads * d + heads * d * h + 3 * h * i + 2 * h
    body = layers * per_layer + h  # + the final norm
    embedding = v * h
    head = v * h
    stored = body + embedding + (0 if config["tie_word_embeddings"] else head)
    read = body + head + batch * h
    return {
        "params": stored,
        "weight_bytes": stored * element,
        "step_weights": read * element,
        "kv_bytes_per_token": 2 * layers * kv_heads * d * element,
    }


@pytest.mark.parametrize("tied", [True, False])
def test_floor_of_a_tied_vocabulary_reads_the_head_once_and_the_embedding_rows(tmp_path, tied):
    config = _tiny_llama(tied)
    info = save_random_weights("tiny-tied", config, tmp_path / "w", torch.float32)
    for batch in (1, 8):
        expected = _expected_bytes(config, batch, 4)
        assert info.params == expected["params"]
        assert info.weight_bytes == expected["weight_bytes"]
        assert info.tied is tied
        assert info.kv_bytes_per_token == expected["kv_bytes_per_token"]
        parts = floor_bytes(info, batch, prompt_len=10, new_tokens=4)
        assert parts["weights"] == expected["step_weights"]
        assert parts["kv_cache"] == int(batch * expected["kv_bytes_per_token"] * (10 + 2 + 1))


@pytest.mark.parametrize("tied", [True, False])
def test_a_model_directory_is_sized_from_its_safetensors(tmp_path, tied):
    config = _tiny_llama(tied)
    saved = save_random_weights("tiny-tied", config, tmp_path / "w", torch.float32)
    if tied:
        # a checkpoint that also stores its tied head must not count it twice
        from safetensors.torch import load_file, save_file

        path = tmp_path / "w" / "model.safetensors"
        tensors = load_file(str(path))
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        save_file(tensors, str(path), metadata={"format": "pt"})
    sized = folder_weights_info(tmp_path / "w", torch.float32)
    expected = _expected_bytes(config, 1, 4)
    assert sized.weight_bytes == expected["weight_bytes"] == saved.weight_bytes
    assert sized.params == expected["params"]
    assert sized.tied is tied
    assert sized.kv_bytes_per_token == expected["kv_bytes_per_token"]
    assert floor_bytes(sized, 1, 10, 4) == floor_bytes(saved, 1, 10, 4)
    # in bfloat16 the engine holds every weight in two bytes
    half = folder_weights_info(tmp_path / "w", torch.bfloat16)
    assert half.weight_bytes == expected["params"] * 2


def test_latency_runs_a_model_directory_as_a_shape(tmp_path):
    config = _tiny_llama(True)
    folder = tmp_path / "tiny-tied"
    save_random_weights("tiny-tied", config, folder, torch.float32)
    out = tmp_path / "latency.json"
    argv = [
        "bench",
        "latency",
        "--device",
        "cpu",
        "--shapes",
        str(folder),
        "--batch-sizes",
        "1",
        "--prompt-len",
        "6",
        "--new-tokens",
        "3",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--attention",
        "torch",
        "--cuda-graphs",
        "off",
        "--transformers",
        "none",
        "--json",
        str(out),
    ]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(argv) == 0
    result = json.loads(out.read_text())
    (shape,) = result["shapes"]
    assert shape["name"] == str(folder)
    assert shape["weight_bytes"] == _expected_bytes(config, 1, 4)["weight_bytes"]
    assert shape["anchors"] == []  # a CPU run has no published figure
    floor = next(c for c in shape["configs"] if c["kind"] == "floor")
    assert (
        floor["batches"][0]["bytes_per_step"]["weights"]
        == _expected_bytes(config, 1, 4)["step_weights"]
    )
    measured = next(c for c in shape["configs"] if c["kind"] == "backplane")
    assert measured["batches"][0]["status"] == "ok"
    assert re.search(re.escape(str(folder)) + r": LlamaForCausalLM", stdout.getvalue())


def test_an_unknown_shape_says_a_directory_is_taken_too(capsys):
    assert main(["bench", "latency", "--device", "cpu", "--shapes", "no-such-shape"]) == 2
    assert "model directory" in capsys.readouterr().err

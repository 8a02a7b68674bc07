"""EngineConfig: sources (file, flags, keywords), validation messages, sizes, auto resolution."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

from backplane.cli.options import add_engine_arguments, config_from_args
from backplane.core.errors import ConfigError
from backplane.engine.config import EngineConfig
from backplane.engine.sizes import format_size, parse_size

KEYS = (
    "model, dtype, device, quantization, kv_cache_dtype, "
    "max_num_seqs, max_num_tokens, max_model_len, max_stop_strings, max_stop_string_length, "
    "page_size, kv_memory, "
    "gpu_memory_utilization, num_kv_pages, host_kv_memory, enable_prefix_caching, cuda_graphs, cuda_graph_buckets, "
    "fused_ops, async_scheduling, threads, tensor_parallel_size, distributed_executor_backend, "
    "custom_all_reduce, "
    "data_parallel_size, speculative_config, seed, debug, backends"
)


def _write(tmp_path, text: str, name: str = "engine.yaml") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser


# -- defaults and sources ---------------------------------------------------------------------


def test_defaults():
    cfg = EngineConfig()
    assert (cfg.model, cfg.dtype, cfg.device, cfg.page_size) == ("tiny-llama", "auto", "auto", 16)
    assert cfg.kv_memory is None and cfg.num_kv_pages is None and cfg.host_kv_memory == 0
    assert cfg.enable_prefix_caching is True and cfg.cuda_graphs is None
    assert cfg.backends == {"attention": "auto", "ssm": "auto", "mla": "auto", "delta": "auto"}
    assert cfg == EngineConfig() and hash(cfg) == hash(EngineConfig())


def test_from_yaml_normalises_values(tmp_path):
    path = _write(
        tmp_path,
        "model: /models/m\n"
        "dtype: bf16\n"
        "device: CUDA:1\n"
        "max_num_seqs: 4\n"
        "max_num_tokens: '64'\n"
        "kv_memory: 256MiB\n"
        "host_kv_memory: 1.5GiB\n"
        "enable_prefix_caching: off\n"
        "cuda_graphs: decode\n"
        "cuda_graph_buckets: [8, 1, 4, 4]\n"
        "backends:\n  ssm: torch\n",
    )
    cfg = EngineConfig.from_yaml(path)
    assert cfg.model == "/models/m"
    assert cfg.dtype == "bfloat16" and cfg.device == "cuda:1"
    assert (cfg.max_num_seqs, cfg.max_num_tokens) == (4, 64)
    assert cfg.kv_memory == 256 * 1024 * 1024
    assert cfg.host_kv_memory == 3 * 1024**3 // 2
    assert cfg.enable_prefix_caching is False
    assert cfg.cuda_graphs == "decode" and cfg.cuda_graph_buckets == (1, 4, 8)
    assert cfg.backends == {"attention": "auto", "ssm": "torch", "mla": "auto", "delta": "auto"}


def test_empty_yaml_gives_defaults_and_overrides_apply(tmp_path):
    cfg = EngineConfig.from_yaml(_write(tmp_path, "# nothing\n"), page_size=32)
    assert cfg == EngineConfig(page_size=32)


def test_merge_overrides_and_merges_backends_per_family():
    base = EngineConfig(backends={"attention": "torch"})
    merged = base.merge(backends={"ssm": "torch"}, seed=7)
    assert merged.backends == {"attention": "torch", "ssm": "torch", "mla": "auto", "delta": "auto"}
    assert merged.seed == 7 and base.seed == 0


def test_cli_flags_override_the_config_file(tmp_path):
    path = _write(tmp_path, "page_size: 8\nseed: 3\nbackends: {attention: torch}\n")
    args = _parser().parse_args(
        [
            "--config",
            path,
            "--page-size",
            "32",
            "--kv-memory",
            "64MiB",
            "--backend",
            "ssm=torch",
            "--no-prefix-caching",
            "--cuda-graph-buckets",
            "4,2",
            "--fused-ops",
            "torch",
            "--debug",
        ]
    )
    cfg = config_from_args(args)
    assert cfg.page_size == 32 and cfg.seed == 3
    assert cfg.kv_memory == 64 * 2**20
    assert cfg.backends["attention"] == "torch" and cfg.backends["ssm"] == "torch"
    assert cfg.enable_prefix_caching is False and cfg.debug is True
    assert cfg.cuda_graph_buckets == (2, 4)
    assert cfg.fused_ops == "torch" and EngineConfig().fused_ops == "auto"


def test_cli_without_flags_is_the_default():
    assert config_from_args(_parser().parse_args([])) == EngineConfig()


# -- errors name the source and the key -------------------------------------------------------


def test_unknown_key_in_file(tmp_path):
    path = _write(tmp_path, "max_num_seq: 4\n")
    with pytest.raises(ConfigError) as err:
        EngineConfig.from_yaml(path)
    assert str(err.value) == (
        f"config file {path!r}, key 'max_num_seq': unknown key (did you mean 'max_num_seqs'?); "
        f"the keys are: {KEYS}"
    )


def test_unknown_keyword_argument():
    with pytest.raises(ConfigError) as err:
        EngineConfig().merge(colour="blue")
    assert str(err.value) == f"EngineConfig argument 'colour': unknown key; the keys are: {KEYS}"


def test_bad_yaml_names_file_and_position(tmp_path):
    path = _write(tmp_path, "model: tiny\nbackends: [attention\n")
    with pytest.raises(ConfigError) as err:
        EngineConfig.from_yaml(path)
    message = str(err.value)
    assert message.startswith(f"config file {path!r} is not valid YAML at line 3, column 1: ")


def test_yaml_that_is_not_a_mapping(tmp_path):
    path = _write(tmp_path, "- model\n- dtype\n")
    with pytest.raises(ConfigError) as err:
        EngineConfig.from_yaml(path)
    assert str(err.value) == (
        f"config file {path!r} must hold a mapping of configuration keys (key: value lines), "
        "not a list"
    )


def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError) as err:
        EngineConfig.from_yaml(path)
    assert str(err.value) == f"cannot read config file {path!r}: No such file or directory"


@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        ("page_size: 0", "page_size", "expected an integer >= 1, got 0"),
        ("page_size: sixteen", "page_size", "expected an integer >= 1, got 'sixteen'"),
        ("max_num_seqs: true", "max_num_seqs", "expected an integer >= 1 or null, got True"),
        ("max_model_len: -5", "max_model_len", "expected an integer >= 1, got -5"),
        ("dtype: int8", "dtype", "expected one of auto, float32, bfloat16, float16, got 'int8'"),
        ("device: tpu", "device", "expected auto, cpu, cuda or cuda:N, got 'tpu'"),
        (
            "cuda_graphs: always",
            "cuda_graphs",
            "expected one of off, decode, piecewise, full_and_piecewise, got 'always'",
        ),
        ("debug: maybe", "debug", "expected true or false, got 'maybe'"),
        ("fused_ops: cuda", "fused_ops", "expected one of auto, torch, triton, got 'cuda'"),
        (
            "kv_memory: 0",
            "kv_memory",
            "expected a size above zero (omit the key for automatic sizing)",
        ),
        ("num_kv_pages: 1", "num_kv_pages", "expected an integer >= 2, got 1"),
        (
            "cuda_graph_buckets: [4, 0]",
            "cuda_graph_buckets",
            "expected a non-empty list of positive integers, got [4, 0]",
        ),
        (
            "backends: torch",
            "backends",
            "expected a mapping of op family to backend name, e.g. {attention: torch}, got 'torch'",
        ),
        ("backends: {ssm: 3}", "backends.ssm", "expected a backend name or auto, got 3"),
        (
            "backends: {atention: torch}",
            "backends.atention",
            "unknown op family (did you mean 'attention'?); the families are: attention, ssm, "
            "mla, delta",
        ),
    ],
)
def test_bad_values_name_file_key_and_what_is_accepted(tmp_path, text, key, problem):
    path = _write(tmp_path, text + "\n")
    with pytest.raises(ConfigError) as err:
        EngineConfig.from_yaml(path)
    assert str(err.value) == f"config file {path!r}, key {key!r}: {problem}"


def test_bad_size_lists_the_units(tmp_path):
    path = _write(tmp_path, "host_kv_memory: 2 parsecs\n")
    with pytest.raises(ConfigError) as err:
        EngineConfig.from_yaml(path)
    assert str(err.value) == (
        f"config file {path!r}, key 'host_kv_memory': expected a size such as 256MiB, 1.5GiB, "
        "512MB or a number of bytes, got '2 parsecs' (units: B, KiB, MiB, GiB, TiB or K, M, G, T "
        "in powers of 1024; KB, MB, GB, TB in powers of 1000)"
    )


def test_bad_flag_names_the_option():
    with pytest.raises(ConfigError) as err:
        config_from_args(_parser().parse_args(["--max-num-seqs", "many"]))
    assert str(err.value) == "option --max-num-seqs: expected an integer >= 1 or null, got 'many'"
    with pytest.raises(ConfigError) as err:
        config_from_args(_parser().parse_args(["--fused-ops", "cuda"]))
    assert str(err.value) == "option --fused-ops: expected one of auto, torch, triton, got 'cuda'"
    with pytest.raises(ConfigError) as err:
        config_from_args(_parser().parse_args(["--backend", "attention:torch"]))
    assert str(err.value) == (
        "option --backend: expected FAMILY=NAME (e.g. attention=torch), got 'attention:torch'"
    )
    with pytest.raises(ConfigError) as err:
        config_from_args(_parser().parse_args(["--backend", "conv=torch"]))
    assert str(err.value) == (
        "option --backend conv=...: unknown op family; the families are: attention, ssm, mla, delta"
    )


def test_keyword_argument_errors_name_the_argument():
    with pytest.raises(ConfigError) as err:
        EngineConfig(page_size="big")
    assert (
        str(err.value) == "EngineConfig argument 'page_size': expected an integer >= 1, got 'big'"
    )


def test_token_budget_must_cover_every_sequence(tmp_path):
    path = _write(tmp_path, "max_num_tokens: 8\n")
    with pytest.raises(ConfigError) as err:
        EngineConfig.from_yaml(path)
    assert str(err.value) == (
        f"config file {path!r}, key 'max_num_tokens': max_num_tokens (8) must be at least "
        f"max_num_seqs ({EngineConfig().max_num_seqs_resolved}), since every running sequence decodes "
        "one token per step"
    )
    with pytest.raises(ConfigError) as err:
        EngineConfig(max_num_seqs=4, max_num_tokens=4).merge(max_num_seqs=5)
    assert str(err.value).startswith("EngineConfig argument 'max_num_seqs': max_num_tokens (4)")


# -- sizes ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (0, 0),
        (4096, 4096),
        ("4096", 4096),
        ("256MiB", 256 * 1024 * 1024),
        ("256mib", 256 * 1024 * 1024),
        ("1GiB", 1024**3),
        ("1 GiB", 1024**3),
        ("1.5GiB", 1024**3 + 512 * 1024**2),
        ("512MB", 512 * 1000**2),
        ("2G", 2 * 1024**3),
        ("3k", 3 * 1024),
        ("10KB", 10_000),
        ("1TiB", 1024**4),
        ("7B", 7),
        (".5KiB", 512),
        (2048.0, 2048),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "MiB", "-1MiB", "1XB", "1.2.3G", True, -1, 1.5, None, [1]])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_format_size():
    assert format_size(512) == "512 B"
    assert format_size(256 * 2**20) == "256.0 MiB"
    assert format_size(3 * 2**40) == "3.0 TiB"


# -- auto resolution --------------------------------------------------------------------------


@pytest.mark.parametrize("cuda", [False, True])
def test_auto_device_dtype_and_graphs_follow_cuda(monkeypatch, cuda):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    cfg = EngineConfig()
    assert cfg.device_resolved == ("cuda" if cuda else "cpu")
    assert cfg.dtype_resolved == ("bfloat16" if cuda else "float32")
    assert cfg.torch_dtype == (torch.bfloat16 if cuda else torch.float32)
    assert cfg.cuda_graphs_resolved == ("full_and_piecewise" if cuda else "off")
    concrete = cfg.resolved()
    assert (concrete.device, concrete.dtype, concrete.cuda_graphs) == (
        cfg.device_resolved,
        cfg.dtype_resolved,
        cfg.cuda_graphs_resolved,
    )


def test_explicit_values_win_and_graphs_are_off_on_cpu(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = EngineConfig(device="cpu", dtype="float16", cuda_graphs="piecewise")
    assert cfg.torch_device == torch.device("cpu")
    assert cfg.torch_dtype == torch.float16
    with caplog.at_level(logging.WARNING, logger="backplane.engine.config"):
        assert cfg.cuda_graphs_resolved == "off"
    assert caplog.messages == [
        "cuda_graphs=piecewise ignored: device cpu is not CUDA; running eagerly"
    ]
    assert EngineConfig(device="cuda:0", cuda_graphs="decode").cuda_graphs_resolved == "decode"


def test_to_dict_round_trips(tmp_path):
    import yaml

    cfg = EngineConfig(kv_memory="1GiB", cuda_graph_buckets=[2, 1], backends={"mla": "torch"})
    path = _write(tmp_path, yaml.safe_dump(cfg.to_dict()))
    assert EngineConfig.from_yaml(path) == cfg


@pytest.mark.parametrize("value", [0, 0.0, 1.5, -0.1, "half", True, None])
def test_gpu_memory_utilization_is_a_fraction(value):
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=value)


def test_custom_all_reduce_is_on_unless_turned_off_by_flag_yaml_or_keyword(tmp_path):
    assert EngineConfig().custom_all_reduce is True
    assert config_from_args(_parser().parse_args([])).custom_all_reduce is True
    assert config_from_args(_parser().parse_args(["--custom-all-reduce"])).custom_all_reduce
    off = config_from_args(_parser().parse_args(["--no-custom-all-reduce"]))
    assert off.custom_all_reduce is False
    assert EngineConfig(custom_all_reduce=False).custom_all_reduce is False
    path = _write(tmp_path, "custom_all_reduce: off\n")
    assert EngineConfig.from_yaml(path).custom_all_reduce is False
    with pytest.raises(ConfigError, match="custom_all_reduce"):
        EngineConfig(custom_all_reduce="sometimes")


def test_gpu_memory_utilization_flag():
    args = _parser().parse_args(["--gpu-memory-utilization", "0.5"])
    assert config_from_args(args).gpu_memory_utilization == 0.5
    assert EngineConfig().gpu_memory_utilization == 0.9


def test_scheduling_limits_left_unset_follow_the_device(monkeypatch):
    from backplane.engine import config as config_module

    monkeypatch.setattr(config_module, "_device_memory", lambda device: None)
    cpu = EngineConfig(device="cpu")
    assert (cpu.max_num_seqs_resolved, cpu.max_num_tokens_resolved) == (32, 2048)
    cuda = EngineConfig(device="cuda")
    assert (cuda.max_num_seqs_resolved, cuda.max_num_tokens_resolved) == (256, 8192)
    # a value that is set is kept, and the budget never falls below the sequence limit
    assert EngineConfig(device="cuda", max_num_seqs=512).max_num_seqs_resolved == 512
    assert EngineConfig(device="cpu", max_num_seqs=4096).max_num_tokens_resolved == 4096
    assert EngineConfig(device="cuda", max_num_tokens=300).max_num_tokens_resolved == 300
    assert cuda.resolved().max_num_seqs == 256 and cuda.resolved().max_num_tokens == 8192
    with pytest.raises(ConfigError, match=r"max_num_tokens \(100\) must be at least max_num_seqs"):
        EngineConfig(device="cuda", max_num_tokens=100)


@pytest.mark.parametrize(
    ("gib", "expected"),
    [(80, (1024, 8192)), (141, (1024, 8192)), (48, (256, 8192)), (24, (256, 8192))],
)
def test_a_large_gpu_admits_more_sequences_by_default(monkeypatch, gib, expected):
    from backplane.engine import config as config_module

    monkeypatch.setattr(config_module, "_device_memory", lambda device: gib * 2**30 - 2**28)
    cuda = EngineConfig(device="cuda:0")
    assert (cuda.max_num_seqs_resolved, cuda.max_num_tokens_resolved) == expected
    # what the user sets is kept on any GPU
    assert EngineConfig(device="cuda", max_num_seqs=64).max_num_seqs_resolved == 64
    assert EngineConfig(device="cuda", max_num_tokens=2048).max_num_tokens_resolved == 2048

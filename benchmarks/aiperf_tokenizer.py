"""A tokenizer for the seeded test models, made offline (run by the AIPerf environment's python,
which has `tokenizers` and AIPerf's text corpus):

    .venv-aiperf/bin/python -P benchmarks/aiperf_tokenizer.py MODEL_FOLDER HF_HOME VOCAB

(-P: benchmarks/aiperf.py must not shadow the aiperf package)

A WordLevel tokenizer trained on AIPerf's own corpus (shakespeare.txt in its package), VOCAB
ids in all with <pad> <s> </s> <unk> as 0-3, split on whitespace and punctuation, no special
tokens added on encode: AIPerf decodes its token blocks to text and the server encodes that text
back to the same ids, one per word. It is written into MODEL_FOLDER, where the engine loads it,
and presented to AIPerf as a Hugging Face cache entry, local/<folder name>, under HF_HOME:
AIPerf's workers run offline and refuse a local path as --tokenizer, but find a cache entry.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "pad_token": "<pad>",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "model_max_length": 1 << 20,
}
REVISION = "0" * 40


def corpus() -> Path:
    import aiperf

    return Path(aiperf.__file__).parent / "dataset" / "generator" / "assets" / "shakespeare.txt"


def build(model: Path, hf_home: Path, vocab: int) -> str:
    """Writes the tokenizer; returns the name AIPerf takes (--tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    if vocab <= len(SPECIALS):
        raise ValueError(f"vocab must be above {len(SPECIALS)}, got {vocab}")
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([str(corpus())], trainers.WordLevelTrainer(vocab_size=vocab, special_tokens=SPECIALS))
    if tok.get_vocab_size() != vocab:
        raise ValueError(f"the corpus gave {tok.get_vocab_size()} words, not {vocab}")
    tok.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps(CONFIG, indent=1))
    (model / "special_tokens_map.json").write_text(json.dumps({k: CONFIG[k] for k in CONFIG if k.endswith("_token")}))
    name = f"local/{model.name}"
    entry = hf_home / "hub" / f"models--local--{model.name}"
    snapshot = entry / "snapshots" / REVISION
    snapshot.mkdir(parents=True, exist_ok=True)
    (entry / "refs").mkdir(exist_ok=True)
    (entry / "refs" / "main").write_text(REVISION)
    for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
        shutil.copy(model / file, snapshot / file)
    return name


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    print(build(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])))
